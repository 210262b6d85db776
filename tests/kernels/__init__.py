"""Tests of specserve.kernels, one folder per path. A package (as its folders are), so that
pytest puts tests/ on sys.path rather than this folder: tests/kernels/triton is never taken for
the triton package."""
