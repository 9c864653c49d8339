import sys

from encoder_svc.server import main

main(sys.argv[1:])
