"""`python -m benchmarks.gpu`: the former name of `python -m benchmarks.backends`."""

import sys

from benchmarks.backends import main

if __name__ == "__main__":
    sys.exit(main())
