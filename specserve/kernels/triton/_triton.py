"""The one guarded Triton import of the kernel modules.

Without triton (a CPU-only install) `triton.jit` becomes a no-op decorator and `tl.constexpr`
a placeholder, so the kernel modules still import and their PyTorch references still work.
"""

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    from types import SimpleNamespace

    HAS_TRITON = False
    triton = SimpleNamespace(jit=lambda fn=None, **kw: fn if fn is not None else (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


# Launch options of every kernel whose rows must give the same bits in each of its compiled
# variants (a tree's rows and the same tokens' decode rows, prefetching or not, any batch): no
# multiply-add is fused unless the kernel asks for it (tl.fma). With fusion on, the PTX keeps
# plain mul/add/sub that ptxas may contract into FMAs as it schedules each variant's code, so
# two variants of one formula can round differently (seen on an H100: tree rows against the
# same tokens' paged rows). With it off, every mul/add/sub is emitted round-to-nearest (.rn),
# which ptxas never contracts. The interpreter ignores the option.
EXACT_FP = {"enable_fp_fusion": False}


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


__all__ = ["EXACT_FP", "HAS_TRITON", "next_pow2", "tl", "triton"]
