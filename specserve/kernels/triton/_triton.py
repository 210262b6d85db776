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


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


__all__ = ["HAS_TRITON", "next_pow2", "tl", "triton"]
