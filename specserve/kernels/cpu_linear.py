"""Linear layers on x86 CPUs through our own AVX2/FMA kernel (`cpu_linear.c`): weight-only
int8 (`PackedInt8`) and float32 (`PackedFloat32`).

torch's int8 weight-only CPU kernel is slower than float32 GEMMs on AVX2-only machines and
its sums depend on how many rows a product has; ours reads a quarter of float32's weight
bytes. Its float32 form streams the weights at memory speed where MKL's GEMM on an AVX2-only
AMD CPU is 2x slower at one row and ~4x at 2-16 (benchmarks/cpu_linear.py). Either way each
row gets the same bits whatever the rest of the batch (see the C source), so speculation stays
token-for-token identical to plain decoding.

Built and loaded by specserve.kernels.cbuild. `available()` says whether it can run here, and
`why_unavailable()` why not: no AVX2/FMA, no compiler, or the build failed.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specserve.kernels.cbuild import Kernel

BLOCK = 64  # columns per block the threads split (BLOCK in cpu_linear.c); strips of 8 inside


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.int8_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, ctypes.c_int]
    lib.int8_linear.restype = None
    lib.f32_linear.argtypes = lib.int8_linear.argtypes
    lib.f32_linear.restype = None


_kernel = Kernel(Path(__file__).with_name("cpu_linear.c"), _declare)


def available() -> bool:
    return _kernel.available()


def why_unavailable() -> str | None:
    return _kernel.why_unavailable()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's layout: strips of 8 columns, k-major inside a strip, [N' / 8, K, 8]
    (N' = N padded with zero columns, never written out, to a multiple of BLOCK)."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // BLOCK) * BLOCK, k)
    padded[:n] = weight
    return padded.view(-1, 8, k).transpose(1, 2).contiguous()


class _Packed:
    """A layer's weights in the kernel's layout with its scales (int8) and bias (float32),
    callable on activations: x [..., K] -> [..., N] float32. The pointers are taken once here:
    a decode step calls a hundred-odd of these."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None,
                 fn) -> None:
        self._fn = fn
        self.out_features, self.in_features = weight.shape
        self.packed = pack(weight.detach().cpu())
        self.scales = None if scales is None else scales.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._args = (self.packed.data_ptr(), self.out_features, 0 if self.scales is None else self.scales.data_ptr(),
                      0 if self.bias is None else self.bias.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # the kernel trusts its sizes
            raise ValueError(f"linear: input has {x.shape[-1]} features, expected {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        if rows.shape[0]:
            self._fn(rows.data_ptr(), rows.shape[0], self.in_features, rows.stride(0), *self._args,
                     y.data_ptr(), self.out_features, torch.get_num_threads())
        return y.view(*x.shape[:-1], self.out_features)


class PackedInt8(_Packed):
    """y = x @ (q * scales[:, None]).T + bias: q int8 [N, K], scales [N]."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert _kernel.lib is not None, _kernel.why_unavailable()
        super().__init__(q.to(torch.int8), scales, bias, _kernel.lib.int8_linear)


class PackedFloat32(_Packed):
    """y = x @ weight.T + bias, weight float32 [N, K]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert _kernel.lib is not None, _kernel.why_unavailable()
        super().__init__(weight.float(), None, bias, _kernel.lib.f32_linear)
