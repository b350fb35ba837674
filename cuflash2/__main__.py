"""`python -m cuflash2 {info,check,bench}`."""

import sys

from cuflash2.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m cuflash2"))
