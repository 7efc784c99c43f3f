import os
import sys

from gates.cli import main

try:
    code = main()
    sys.stdout.flush()
except BrokenPipeError:  # the reader went away (`python -m gates show 05 | head`): stop quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 0
sys.exit(code)
