"""The batch-invariant Triton kernels compile for an H100 (sm_90) with no multiply-add left for
ptxas to fuse (triton/_triton.py, EXACT_FP).

A kernel's compiled variants (tree or paged rows, prefetching or not, a batch of any size) must
round a row's formula alike. With Triton's default fusion the PTX holds plain `mul.f32` /
`add.f32` / `sub.f32`, which ptxas contracts into FMAs as it schedules each variant; rows of the
same tokens then differed between the tree and the paged kernel on an H100. Only the PTX is
needed here, which Triton's NVIDIA backend builds without a GPU: each public entry point is
called on CPU tensors with its kernels' launches captured (nothing runs), in a process of its
own, since the kernel tests run under the interpreter.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = r'''
import json, re, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
from specserve.kernels.triton import fused, matmul, paged_attention as pa, rms_norm
from specserve.kernels.triton.tree_attention import causal_tree_mask

launches = []

class Capture:
    def __init__(self, kernel):
        self.kernel = kernel
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

for module, names in ((pa, ("_attn_fused_kernel", "_attn_split_kernel", "_attn_reduce_kernel")),
                      (rms_norm, ("_rms_norm_kernel",)), (fused, ("_rotary_kernel", "_silu_mul_kernel")),
                      (matmul, ("_linear_kernel", "_linear_reduce_kernel"))):
    for name in names:
        setattr(module, name, Capture(getattr(module, name)))

bf16 = torch.bfloat16
T, Hq, Hkv, D, bs = 3, 8, 2, 128, 16
q = torch.zeros(T, Hq, D, dtype=bf16)
cache = torch.zeros(8, bs, Hkv, D, dtype=bf16)
tables = torch.zeros(1, 32, dtype=torch.int32)  # 512 keys: two partitions
seq_lens, starts = torch.tensor([300], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32)
for tree in (None, causal_tree_mask(T, 1)):
    for split in (False, True):
        pa.launch_paged_attn(q, cache, cache, tables, seq_lens, starts, 0.1, T, tree_mask=tree, split=split)
x = torch.zeros(4, 576, dtype=bf16)
rms_norm.add_rms_norm_invariant_triton(x, x, torch.ones(576, dtype=bf16), 1e-5)
cs = torch.zeros(4, 1, 32, dtype=bf16)
fused.rotary_triton(torch.zeros(4, 3 * 64, dtype=bf16), cs, cs, 3, 64)
fused.silu_mul_triton(torch.zeros(4, 2 * 1536, dtype=bf16))
for split in (False, True):
    matmul.linear_invariant_triton(x, torch.zeros(1536, 576, dtype=bf16), split=split)

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
         torch.int64: "*i64"}
FLOAT_OP = re.compile(r"\b(?:add|sub|mul)(\.[a-z0-9]+)*\.f32\b")
report = {}
for kernel, args, kwargs in launches:
    names = [p.name for p in kernel.params]
    bound = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, constexprs = {}, {}
    for p in kernel.params:
        value = bound[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = TYPES[value.dtype]
        else:
            signature[p.name] = "fp32" if isinstance(value, float) else "i32"
    ptx = triton_compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                         options=options).asm["ptx"]
    fusable = sorted({m.group(0) for m in FLOAT_OP.finditer(ptx) if ".rn" not in m.group(0)})
    form = ",".join(f"{k}={v}" for k, v in constexprs.items() if k in ("TREE_MASK", "FUSED"))
    key = f"{kernel.fn.__name__}[{form}]"
    report[key] = {"fusable": fusable, "options": {k: str(v) for k, v in options.items()}}
json.dump(report, sys.stdout)
'''

EXPECTED = {"_attn_fused_kernel[TREE_MASK=False]", "_attn_fused_kernel[TREE_MASK=True]",
            "_attn_split_kernel[TREE_MASK=False]", "_attn_split_kernel[TREE_MASK=True]", "_attn_reduce_kernel[]",
            "_rms_norm_kernel[]", "_rotary_kernel[]", "_silu_mul_kernel[]", "_linear_kernel[FUSED=True]",
            "_linear_kernel[FUSED=False]", "_linear_reduce_kernel[]"}


def test_no_multiply_add_is_left_for_ptxas_to_fuse():
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert set(report) == EXPECTED  # every batch-invariant kernel, in each form the launchers use
    assert {k: v["fusable"] for k, v in report.items() if v["fusable"]} == {}
