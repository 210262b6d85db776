"""Linear layers on x86 CPUs through our own AVX2/FMA kernel (`cpu_linear.c`): weight-only
int8 (`PackedInt8`) and float32 (`PackedFloat32`, or `pack_float32`: in GGUF's Q4_1 or Q8_0
block format where that holds the float32 weights exactly).

torch's int8 weight-only CPU kernel is slower than float32 GEMMs on AVX2-only machines and
its sums depend on how many rows a product has; ours reads a quarter of float32's weight
bytes. Its float32 form streams the weights at memory speed where MKL's GEMM on an AVX2-only
AMD CPU is 2x slower at one row and ~4x at 2-16 (benchmarks/cpu_linear.py). Either way each
row gets the same bits whatever the rest of the batch (see the C source), so speculation stays
token-for-token identical to plain decoding.

A model converted from a GGUF file holds float32 weights that are dequantized Q4_1 or Q8_0
blocks: every block of 32 weights of a row is d * q + m (Q4_1: q in 0..15, d and m float16) or
d * q (Q8_0: q in -127..127). `pack_float32` finds those d, m and q again and keeps only them
(0.625 or 1.06 bytes a weight instead of 4), after checking that they give back every weight
bit for bit. The kernel rebuilds each weight before its multiply-add (d * q is exact in
float32, so d * q + m rounds once, where GGUF's dequantization rounds), so the products, and
the model's tokens, are exactly the float32 model's.

`pack_a8` packs the same blocks for `a8_linear.c` (`--quantization gguf`): each row of
activations quantized to int8 per block of 32, and a block's dot product one exact integer sum,
as GGUF runtimes multiply (close to the float32 products, not the same; a row's bits still do
not depend on the batch). Weights that are not such blocks become Q8_0 blocks there.

Built and loaded by specserve.kernels.cpu.cbuild. `available()` says whether it can run here, and
`why_unavailable()` why not: no AVX2/FMA, no compiler, or the build failed.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from specserve.kernels.cpu.cbuild import Kernel

BLOCK = 64  # columns per block the threads split (BLOCK in cpu_linear.c); strips of 8 inside
QK = 32  # weights per Q4_1 / Q8_0 block along k (QK in cpu_linear.c)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.int8_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, ctypes.c_int]
    lib.int8_linear.restype = None
    for name in ("f32_linear", "q4_1_linear", "q8_0_linear"):
        getattr(lib, name).argtypes = lib.int8_linear.argtypes
        getattr(lib, name).restype = None
    lib.cpu_linear_wide.argtypes = [ctypes.c_int]
    lib.cpu_linear_wide.restype = ctypes.c_int
    lib.cpu_linear_direct_rows.argtypes = [ctypes.c_int]
    lib.cpu_linear_direct_rows.restype = ctypes.c_int
    lib.q8_0_argmax_head.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_float, ptr, i64,
                                     ctypes.c_int]
    lib.q8_0_argmax_head.restype = i64
    # the emulated AVX2 machine (docs/benchmarks.md) keeps our kernels to AVX2 as well
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
        lib.cpu_linear_wide(0)


def _declare_a8(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("q4_1_a8_linear", "q8_0_a8_linear"):
        getattr(lib, name).argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, ctypes.c_int]
        getattr(lib, name).restype = ctypes.c_int
    lib.a8_linear_vnni.argtypes = [ctypes.c_int]
    lib.a8_linear_vnni.restype = ctypes.c_int
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
        lib.a8_linear_vnni(0)


_kernel = Kernel(Path(__file__).with_name("cpu_linear.c"), _declare)
_a8_kernel = Kernel(Path(__file__).with_name("a8_linear.c"), _declare_a8)


def available() -> bool:
    return _kernel.available()


def why_unavailable() -> str | None:
    return _kernel.why_unavailable()


def a8_available() -> bool:
    return _a8_kernel.available()


def a8_why_unavailable() -> str | None:
    return _a8_kernel.why_unavailable()


def a8_vnni(on: bool | None = None) -> bool:
    """Whether the int8-activation products (`pack_a8`) run with AVX512-VNNI (64 multiply-adds
    an instruction) or AVX2 (32): the same bits either way. on: True / False sets it (True only
    takes where the CPU has AVX512-VNNI and AVX512-BW), None asks. Off under
    ATEN_CPU_CAPABILITY=avx2 or default (the emulated AVX2 machine)."""
    return bool(_a8_kernel.lib.a8_linear_vnni(-1 if on is None else int(on)))


def wide(on: bool | None = None) -> bool:
    """Whether the block formats' products (direct tiles and chunk path) use AVX-512 (the
    same bits as AVX2, twice the columns per instruction); on: True / False sets it (True only
    takes where the CPU has AVX-512F), None asks. Off under ATEN_CPU_CAPABILITY=avx2 or
    default; model.quant.pick_wide_blocks sets it from a measurement at start."""
    return bool(_kernel.lib.cpu_linear_wide(-1 if on is None else int(on)))


def direct_rows(n: int | None = None) -> int:
    """The most rows the block formats multiply through their direct tiles (the weights
    rebuilt in registers, once per tile of rows) before the chunk path (a chunk of weights rebuilt into a
    buffer, then read by every row): 12 with AVX2, 28 with AVX-512, the same bits either way.
    n sets a lower limit (0: the most there are), None asks; for benchmarks."""
    return _kernel.lib.cpu_linear_direct_rows(-1 if n is None else n)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N', ...], N' = N padded with zeros to a multiple of BLOCK (columns never
    written out)."""
    n = t.shape[0]
    padded = t.new_zeros(-(-n // BLOCK) * BLOCK, *t.shape[1:])
    padded[:n] = t
    return padded


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's layout: strips of 8 columns, k-major inside a strip, [N' / 8, K, 8]."""
    return _pad_rows(weight).view(-1, 8, weight.shape[1]).transpose(1, 2).contiguous()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.view(torch.int32) == b.view(torch.int32)


def _q8_0_blocks(w: torch.Tensor):
    """w [N, K / QK, QK] float32 -> (d float16 [N, K / QK], q int8 [N, K / QK, QK]) with
    d * q == w bit for bit, or None. The largest magnitude of a block is 127 d exactly."""
    d = w.abs().amax(-1).div_(127)
    d16 = d.half()
    if not torch.equal(d16.float(), d):
        return None
    q = w / torch.where(d > 0, d, 1)[..., None]
    q.round_()
    if not (bool(q.abs().le(127).all()) and bool(_bits_equal(q * d[..., None], w).all())):
        return None
    return d16, q.to(torch.int8)


def _q4_1_fit(w: torch.Tensor, m: torch.Tensor, d: torch.Tensor):
    """(q, which blocks d * q + m rebuilds bit for bit) for blocks w [B, QK], m and d [B]."""
    q = (w - m[:, None]).div_(torch.where(d > 0, d, 1)[:, None]).round_().clamp_(0, 15)
    return q, _bits_equal((q * d[:, None]).add_(m[:, None]), w).all(-1)


def _q4_1_blocks(w: torch.Tensor):
    """w [N, K / QK, QK] float32 -> (d, m float16 [N, K / QK], q uint8 [N, K / QK, QK] in
    0..15) with d * q + m == w bit for bit (GGUF's dequantization), or None. m is the block's
    smallest weight (q = 0); d is within one float16 step of (largest - m) / 15."""
    shape = w.shape[:-1]
    w = w.reshape(-1, QK)
    m = w.amin(-1)
    m16 = m.half()
    if not torch.equal(m16.float(), m):
        return None
    d16 = ((w.amax(-1) - m) / 15).half()
    q, ok = _q4_1_fit(w, m, d16.float())
    for step in (1, -1):  # blocks where rounding to float16 missed: the neighbouring values
        bad = (~ok).nonzero().squeeze(1)
        if not len(bad):
            break
        d = (d16[bad].view(torch.int16) + step).view(torch.float16)
        d = torch.where(d16[bad].float() > 0, d, d16[bad])  # no neighbour below 0
        q_bad, ok_bad = _q4_1_fit(w[bad], m[bad], d.float())
        fixed = bad[ok_bad]
        d16[fixed], q[fixed], ok[fixed] = d[ok_bad], q_bad[ok_bad], True
    if not bool(ok.all()):
        return None
    return d16.view(shape), m16.view(shape), q.to(torch.uint8).view(*shape, QK)


def _strips(t: torch.Tensor) -> torch.Tensor:
    """A field per block [N', K / QK, F] -> bytes [N' / 8, K / QK, F * 8 * itemsize]: for each
    strip and block, F groups of the strip's 8 columns side by side."""
    n, kb, f = t.shape
    return t.view(n // 8, 8, kb, f).permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(n // 8, kb, -1)


def pack_blocks(weight: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """[N, K] float32 -> ("q4_1" or "q8_0", the packed strips as bytes) when the weights are
    exactly such blocks (module docstring), else None."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or k % QK or not bool(torch.isfinite(weight).all()):
        return None
    w = weight.detach().reshape(n, k // QK, QK)
    found = _q4_1_blocks(w)
    if found is not None:
        d, m, q = (_pad_rows(t) for t in found)
        pairs = q.view(q.shape[0], k // QK, QK // 2, 2)
        nibbles = pairs[..., 0] | (pairs[..., 1] << 4)  # [N', K / QK, 16]: low nibble k, high k + 1
        return "q4_1", torch.cat([_strips(d[..., None]), _strips(m[..., None]), _strips(nibbles)], -1).contiguous()
    found = _q8_0_blocks(w)
    if found is not None:
        d, q = (_pad_rows(t) for t in found)
        return "q8_0", torch.cat([_strips(d[..., None]), _strips(q)], -1).contiguous()
    return None


class _Packed:
    """A layer's weights in the kernel's layout with its scales (int8) and bias (float32),
    callable on activations: x [..., K] -> [..., N] float32. The pointers are taken once here:
    a decode step calls a hundred-odd of these."""

    def __init__(self, packed: torch.Tensor, shape: tuple[int, int], scales: torch.Tensor | None,
                 bias: torch.Tensor | None, fn) -> None:
        self._fn = fn
        self.out_features, self.in_features = shape
        self.packed = packed
        self.scales = None if scales is None else scales.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._args = (self.packed.data_ptr(), self.out_features, 0 if self.scales is None else self.scales.data_ptr(),
                      0 if self.bias is None else self.bias.data_ptr())

    def c_entry(self) -> tuple[int, bool, int, int, int, int]:
        """What a caller in C passes to run this product (decoder.c): the address of the
        kernel's function, whether it returns a status (the int8-activation kernels: -1 when
        out of memory), then the packed weights, output columns, scales and bias (0: none)."""
        return (ctypes.cast(self._fn, ctypes.c_void_p).value, self._fn.restype is not None, *self._args)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # the kernel trusts its sizes
            raise ValueError(f"linear: input has {x.shape[-1]} features, expected {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        if rows.shape[0]:
            failed = self._fn(rows.data_ptr(), rows.shape[0], self.in_features, rows.stride(0), *self._args,
                              y.data_ptr(), self.out_features, torch.get_num_threads())
            if failed:  # (the int8-activation kernels' buffers)
                raise MemoryError(f"linear: no memory for a product of {rows.shape[0]} rows")
        return y.view(*x.shape[:-1], self.out_features)


class PackedInt8(_Packed):
    """y = x @ (q * scales[:, None]).T + bias: q int8 [N, K], scales [N]."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert _kernel.lib is not None, _kernel.why_unavailable()
        super().__init__(pack(q.detach().cpu().to(torch.int8)), tuple(q.shape), scales, bias, _kernel.lib.int8_linear)


class PackedFloat32(_Packed):
    """y = x @ weight.T + bias, weight float32 [N, K]; `fmt` "q4_1" / "q8_0" with `packed` from
    `pack_blocks` (the same products), else the weights as they are."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str = "f32",
                 packed: torch.Tensor | None = None) -> None:
        assert _kernel.lib is not None, _kernel.why_unavailable()
        self.format = fmt
        if packed is None:
            packed = pack(weight.detach().cpu().float())
        super().__init__(packed, tuple(weight.shape), None, bias, getattr(_kernel.lib, f"{fmt}_linear"))


def pack_float32(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedFloat32:
    """A float32 layer through our kernel in the fewest bytes that give the same products:
    Q4_1 or Q8_0 blocks where the weights are exactly such blocks, else float32."""
    found = pack_blocks(weight.detach().cpu().float())
    if found is None:
        return PackedFloat32(weight, bias)
    return PackedFloat32(weight, bias, *found)


A8_STRIP = 16  # columns per strip of pack_a8's layout (a8_linear.c)


def _q8_0_quantize(w: torch.Tensor):
    """w [N, K / QK, QK] float32 -> (d float16, q int8) of GGUF's Q8_0 for weights that are not
    blocks already: d = max |w| / 127 rounded to float16, q = round(w / d)."""
    d16 = (w.abs().amax(-1) / 127).half()
    d = d16.float()
    q = (w / torch.where(d > 0, d, 1)[..., None]).round_().clamp_(-127, 127)
    return d16, q.to(torch.int8)


def _a8_strips(t: torch.Tensor) -> torch.Tensor:
    """A per-column, per-block field [N', K / QK, F] -> bytes [N' / 16, K / QK, 16 * F * itemsize]:
    for each strip of 16 columns and block, the field's values column by column."""
    n, kb, f = t.shape
    return t.view(n // A8_STRIP, A8_STRIP, kb, f).transpose(1, 2).contiguous().view(torch.uint8).reshape(
        n // A8_STRIP, kb, -1)


def _a8_values(q: torch.Tensor, group: int) -> torch.Tensor:
    """q [N', K / QK, QK] uint8 -> [N' / 16, K / QK, QK * 16 / (group / 4)] bytes in vpdpbusd's
    order: groups of `group` k (8 for Q4_1's nibbles, 4 for Q8_0's bytes), each the strip's 16
    columns' 4 bytes side by side; a Q4_1 byte holds k = 8g + j (low nibble) and 8g + 4 + j."""
    n, kb, _ = q.shape
    q = q.view(n // A8_STRIP, A8_STRIP, kb, QK // group, group // 4, 4)  # [S, c, kb, g, half, j]
    if group == 8:
        q = q[..., 0, :] | (q[..., 1, :] << 4)  # [S, c, kb, g, j]
    else:
        q = q[..., 0, :]
    return q.permute(0, 2, 3, 1, 4).contiguous().reshape(n // A8_STRIP, kb, -1)


def pack_a8(weight: torch.Tensor, bias: torch.Tensor | None) -> "PackedA8":
    """A float32 layer [N, K] for `a8_linear.c`: its Q4_1 blocks where the weights are exactly
    such blocks, else Q8_0 blocks (exactly, where they are, or quantized to them)."""
    w = weight.detach().cpu().float()
    n, k = w.shape
    if k % QK:
        raise ValueError(f"--quantization gguf: {k} input features is not a multiple of {QK}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("--quantization gguf: a layer's weights are not all finite")
    blocks = w.reshape(n, k // QK, QK)
    found = _q4_1_blocks(blocks)
    if found is not None:
        d, m, q = (_pad_rows(t) for t in found)
        packed = torch.cat([_a8_strips(d[..., None]), _a8_strips(m[..., None]), _a8_values(q, 8)], -1)
        return PackedA8(packed.contiguous(), (n, k), bias, "q4_1")
    found = _q8_0_blocks(blocks) or _q8_0_quantize(blocks)
    d, q = (_pad_rows(t) for t in found)
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)  # vpdpbusd multiplies unsigned by signed bytes
    packed = torch.cat([_a8_strips(d[..., None]), _a8_values(shifted, 4)], -1)
    return PackedA8(packed.contiguous(), (n, k), bias, "q8_0")


class PackedA8(_Packed):
    """y = x @ W.T + bias with x quantized per row and block of 32 to int8 and W in Q4_1 or
    Q8_0 blocks (`pack_a8`, a8_linear.c)."""

    def __init__(self, packed: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None, fmt: str) -> None:
        assert _a8_kernel.lib is not None, _a8_kernel.why_unavailable()
        self.format = fmt
        super().__init__(packed, shape, None, bias, getattr(_a8_kernel.lib, f"{fmt}_a8_linear"))


class ArgmaxHead:
    """An LM head in Q8_0 blocks for rows whose only use is their argmax (greedy decoding and
    verification with nothing changing the logits): the int8-activation product (`pack_a8`,
    2-3x fewer instructions), then, per row, the exact float32 products of only the blocks of
    64 columns that may hold the row's largest value (cpu_linear.c, q8_0_argmax_head: a
    per-column bound on the approximation's error decides which). The row's argmax is then
    exactly that of the full float32 product (`exact`'s, bit for bit where computed); its other
    values are the approximation's, below the largest, and not for any other use (logprobs,
    sampling, penalties, grammars take `exact`). `exact_blocks` counts the blocks computed
    exactly, for benchmarks. Memory: the int8 product's own copy of the blocks (1.06 bytes a
    weight) and the per-block sums of |w| twice (8 bytes per column and block of 32)."""

    def __init__(self, exact: PackedFloat32, weight: torch.Tensor) -> None:
        if exact.format != "q8_0":
            raise ValueError(f"ArgmaxHead: a head in Q8_0 blocks, not {exact.format}")
        w = weight.detach().cpu().float()
        n, k = w.shape
        self.exact, self.approx = exact, pack_a8(w, None)
        if self.approx.format != "q8_0":
            raise ValueError("ArgmaxHead: the int8-activation product of the same Q8_0 blocks")
        self.in_features, self.out_features = k, n
        per_block = w.abs().view(n, k // QK, QK).sum(-1, dtype=torch.float64)  # exact: d * integers
        self.bounds = per_block.float().contiguous()  # [N, K / QK]
        self.bounds_by_block = self.bounds.t().contiguous()  # [K / QK, N]
        self.norms = per_block.sum(-1).float().contiguous()  # [N]: sum |w| of a column
        # dx / 2 for rounding x to int8, plus both products' float32 roundings, with 2x margin
        self.coef = 0.501 + 2 * (k + 2 * k // QK + 4) * 2.0 ** -24 * 128
        self.exact_blocks = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        y = self.approx(rows)
        if rows.shape[0]:
            done = _kernel.lib.q8_0_argmax_head(
                rows.data_ptr(), rows.shape[0], self.in_features, rows.stride(0), self.exact.packed.data_ptr(),
                self.out_features, self.norms.data_ptr(), self.bounds.data_ptr(), self.bounds_by_block.data_ptr(),
                ctypes.c_float(self.coef), y.data_ptr(), self.out_features, torch.get_num_threads())
            if done < 0:
                raise MemoryError(f"argmax head: no memory for {rows.shape[0]} rows")
            self.exact_blocks += done
        return y.view(*x.shape[:-1], self.out_features)
