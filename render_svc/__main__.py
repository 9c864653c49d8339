import sys

from render_svc.server import main

main(sys.argv[1:])
