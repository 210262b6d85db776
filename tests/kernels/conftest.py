"""Kernel test setup.

Without CUDA the Triton kernels run under the interpreter: Triton 3.x reads
TRITON_INTERPRET (triton.knobs.runtime.interpret) when ``@triton.jit`` decorates
a function, i.e. when specserve.kernels.* is imported, so it is set here before
that import.  If something imported the kernel modules earlier without it, they
are re-imported (together with triton's Python modules) so every @triton.jit
function is re-decorated as an interpreted one.
"""
import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        # triton.language's own @jit helpers (tl.max, tl.cdiv, ...) and our kernels
        # were decorated in compiled mode: re-import the pure-Python parts (the
        # C extension triton._C stays loaded) and our kernel modules.
        for name in [m for m in sys.modules if (m == "triton" or m.startswith("triton."))
                     and not m.startswith("triton._C") or m.startswith("specserve.kernels")]:
            del sys.modules[name]
        importlib.import_module("triton")
        importlib.import_module("specserve.kernels")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False



def _make_batch(q_lens, prefix_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                dtype=torch.float32, device="cpu", extra_blocks=3, seed=0):
    """Random paged batch.  Blocks are shuffled and block-table padding points at
    other (random, valid) blocks so reading past seq_len would change results."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + extra_blocks
    max_blocks = max(need) + 2
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.randint(0, num_blocks, (len(q_lens), max_blocks), generator=g)
    c = 0
    for b, nb in enumerate(need):
        block_tables[b, :nb] = perm[c:c + nb]
        c += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    T = sum(q_lens)
    q = torch.randn(T, num_q_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache,
                block_tables=block_tables.to(device=device, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                query_start_loc=qsl.to(device), scale=head_dim ** -0.5)


@pytest.fixture
def make_batch():
    return _make_batch
