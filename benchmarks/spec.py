"""Wrapper: python benchmarks/spec.py [args] == specserve bench spec [args]."""

import sys

from specserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "spec", *sys.argv[1:]]))
