"""Tests of the CPU's C kernels (specserve.kernels.cpu)."""
