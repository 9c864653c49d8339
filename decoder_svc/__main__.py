import sys

from decoder_svc.server import main

main(sys.argv[1:])
