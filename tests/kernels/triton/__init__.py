"""Tests of the Triton kernels and their PyTorch references (specserve.kernels.triton)."""
