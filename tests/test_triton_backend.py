"""The engine on the Triton attention backend (interpreted on CPU) equals the torch backend.

Runs in a subprocess: TRITON_INTERPRET must be set before triton is imported.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
from specserve import LLM, SamplingParams
# every draft verified (no cost model to calibrate: its timed steps would run interpreted)
llm = LLM(sys.argv[1], max_model_len=128, num_blocks=32, block_size=16, dtype="float32",
          speculative_config={"method": "ngram", "adaptive": False})
prompts = ["hello world, this is a longer prompt that spans more than one block of sixteen", "hi"]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
print(json.dumps({"backend": type(llm.engine.runner.backend).__name__,
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def _run(model_dir, backend):
    env = dict(os.environ, SPECSERVE_ATTENTION_BACKEND=backend, TRITON_INTERPRET="1",
               SPECSERVE_KERNELS="triton" if backend == "triton" else "torch")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_backend_matches_torch(tiny_model_dir):
    pytest.importorskip("triton")
    ref = _run(tiny_model_dir, "torch")
    tri = _run(tiny_model_dir, "triton")
    assert ref["backend"] == "TorchAttention" and tri["backend"] == "TritonAttention"
    assert tri["tokens"] == ref["tokens"]
