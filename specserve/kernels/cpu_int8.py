"""Weight-only int8 linear layers on x86 CPUs: our own AVX2/FMA kernel (`int8_linear.c`).

torch's int8 weight-only CPU kernel is slower than float32 GEMMs on AVX2-only machines and
its sums depend on how many rows a product has; this one reads a quarter of float32's weight
bytes and gives each row the same bits whatever the rest of the batch (see the C source), so
speculation over an int8 target stays token-for-token identical to plain decoding.

Built and loaded by specserve.kernels.cbuild. `available()` says whether it can run here, and
`why_unavailable()` why not: no AVX2/FMA, no compiler, or the build failed.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specserve.kernels.cbuild import Kernel

BLOCK = 64  # columns per block the threads split (BLOCK in int8_linear.c); strips of 8 inside


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.int8_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, ctypes.c_int]
    lib.int8_linear.restype = None


_kernel = Kernel(Path(__file__).with_name("int8_linear.c"), _declare)


def available() -> bool:
    return _kernel.available()


def why_unavailable() -> str | None:
    return _kernel.why_unavailable()


class PackedInt8:
    """A layer's int8 weights in the kernel's layout, with their scales and bias (float32),
    callable on activations: x [..., K] -> [..., N] float32 = x @ (q * scales[:, None]).T + bias.
    The pointers are taken once here: a decode step calls a hundred-odd of these."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        lib = _kernel.lib
        assert lib is not None, _kernel.why_unavailable()
        q = q.detach().to(device="cpu", dtype=torch.int8)
        self.out_features, self.in_features = n, k = q.shape
        padded = torch.zeros(-(-n // BLOCK) * BLOCK, k, dtype=torch.int8)  # zero columns never written
        padded[:n] = q
        # [N, K] -> strips of 8 columns, k-major inside a strip: [N / 8, K, 8]
        self.packed = padded.view(-1, 8, k).transpose(1, 2).contiguous()
        self.scales = scales.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._fn = lib.int8_linear
        self._weights = self.packed.data_ptr()
        self._scales = self.scales.data_ptr()
        self._bias = 0 if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # the kernel trusts its sizes
            raise ValueError(f"int8 linear: input has {x.shape[-1]} features, expected {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        m, n = rows.shape[0], self.out_features
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            self._fn(rows.data_ptr(), m, self.in_features, rows.stride(0), self._weights, n,
                     self._scales, self._bias, y.data_ptr(), n, torch.get_num_threads())
        return y.view(*x.shape[:-1], n)
