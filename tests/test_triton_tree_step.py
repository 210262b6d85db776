"""The CUDA backend's tree path (TritonAttention: packed tree mask, tree kernel) against
TorchAttention, through a tiny model's forward pass over one step of draft trees.

The step is what the runner builds for tree verification: tree rows at prefix + depth
(tree_mask.tree_positions), each backend's own metadata from the same tree parents. It mixes
requests with and without trees (a decode, a causal verify chain, a prefill chunk), one tree
deeper than a KV block whose nodes need two mask words, and a small bushy one. The Triton
kernels run interpreted on CPU, in a subprocess: TRITON_INTERPRET must be set before triton
is first imported.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, random
import torch
from specserve.model import tree_mask
from specserve.model.arch import ModelArch
from specserve.model.attention import TorchAttention, TritonAttention
from specserve.model.llama import LlamaForCausalLM

BLOCK = 16
arch = ModelArch.from_dict({"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
torch.manual_seed(0)
model = LlamaForCausalLM(arch, max_positions=256).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.3)
model.finalize_weights()

deep = [-1] + list(range(20)) + [0, 5, 5, 12, 19, 19, 24, 3, 28, 28, 8, 17, 31, 33, 1]  # depth 20, 36 nodes
bushy = [-1, 0, 0, 1, 1, 2, 3]
# (prefix, new tokens, tree parents or None)
reqs = [(5, len(deep), deep), (30, 1, None), (17, 4, None), (40, len(bushy), bushy), (0, 12, None)]
rng = random.Random(0)
need = [-(-(p + n) // BLOCK) for p, n, _ in reqs]
blocks = list(range(sum(need) + 2))
rng.shuffle(blocks)
tables = [blocks[sum(need[:i]):sum(need[:i + 1])] for i in range(len(reqs))]
shape = (len(blocks), BLOCK, arch.num_kv_heads, arch.head_dim)
caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(arch.num_layers)]  # the prefixes' K/V

seq_lens = [p + n for p, n, _ in reqs]
query_lens = [n for _, n, _ in reqs]
parents = [t for _, _, t in reqs]
ids = torch.randint(0, arch.vocab_size, (sum(query_lens),))
positions = [i for p, n, _ in reqs for i in range(p, p + n)]
positions = torch.tensor(tree_mask.tree_positions(positions, query_lens, parents))

def step(backend, tree_parents=parents):
    mine = [(k.clone(), v.clone()) for k, v in caches]
    meta = backend.build_metadata(seq_lens, query_lens, tables, BLOCK, torch.device("cpu"), tree_parents)
    with torch.inference_mode():
        return model(ids, positions, mine, meta, backend), mine, meta

ref, ref_caches, _ = step(TorchAttention())
out, out_caches, meta = step(TritonAttention())
causal, _, _ = step(TorchAttention(), None)  # the same rows with the trees ignored
tree_rows = torch.cat([torch.arange(sum(query_lens[:i]), sum(query_lens[:i + 1])) for i in (0, 3)])
print(json.dumps({
    "mask_words": meta.tree_mask.shape[1],
    "max_err": (out - ref).abs().max().item(),
    # layer 0 writes the same K/V bits; later layers' K/V inherit the attention's rounding
    "first_layer_kv_equal": all(torch.equal(a, b) for a, b in zip(out_caches[0], ref_caches[0])),
    "kv_err": max((a - b).abs().max().item() for x, y in zip(out_caches, ref_caches) for a, b in zip(x, y)),
    "tree_effect": (causal - ref)[tree_rows].abs().max().item(),
}))
"""


def test_triton_tree_step_matches_torch():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", SPECSERVE_KERNELS="triton")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["mask_words"] == 2  # the deep tree's 36 nodes need two words
    assert r["first_layer_kv_equal"]  # write_kv wrote the same K/V into the same slots
    assert r["max_err"] < 1e-4 and r["kv_err"] < 1e-4, r
    assert r["tree_effect"] > 1e-2, r  # the trees changed their rows: the masks were applied
