"""Wrapper: python benchmarks/spec.py [args] == specserve bench spec [args]."""

from specserve.bench.spec import main

if __name__ == "__main__":
    main()
