import sys

from dit_svc.server import main

main(sys.argv[1:])
