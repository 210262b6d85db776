"""Offline throughput, specserve vs transformers generate(): same as `specserve bench offline`."""

import argparse
import sys

from specserve.bench import offline

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=offline.__doc__.splitlines()[0])
    offline.add_args(parser)
    sys.exit(offline.run(parser.parse_args()))
