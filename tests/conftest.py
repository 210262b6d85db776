"""Shared fixtures: the default model (loaded once), tiny random models, and the leak check.

Every Engine a test builds through `make_llm` or the session-wide `llm` is checked after each
test: all of its KV blocks must be back in the pool.
"""

from __future__ import annotations

import importlib.util
import json
import os
import weakref
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# every engine made and still alive (weak: one that a finished test dropped goes, with its KV
# cache, instead of holding a gigabyte to the end of the session), and those of the running
# test (held until its check)
_ENGINES: weakref.WeakSet = weakref.WeakSet()
_TEST_ENGINES: list = []


def _register(llm):
    _ENGINES.add(llm.engine)
    _TEST_ENGINES.append(llm.engine)
    return llm


@pytest.fixture(scope="session")
def llm():
    """The default model (SmolLM2-135M-Instruct) decoding plainly: the reference that
    speculative engines are compared with."""
    from specserve import LLM

    return _register(LLM(max_model_len=2048, speculative_config=None))


@pytest.fixture(scope="session")
def make_llm():
    from specserve import LLM

    def make(*args, **kwargs):
        return _register(LLM(*args, **kwargs))

    return make


@pytest.fixture(autouse=True)
def _blocks_back_in_pool():
    """After every test, every engine it used is idle and holds no KV block. A test that left
    requests behind fails (they are aborted first, so the next test starts clean)."""
    yield
    problems = []
    engines = {id(e): e for e in [*_TEST_ENGINES, *_ENGINES]}.values()
    _TEST_ENGINES.clear()
    for engine in engines:
        if engine.has_unfinished_requests():
            problems.append(f"requests left unfinished: {sorted(engine.requests)}")
            for rid in list(engine.requests):
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
        kv = engine.kv
        if kv.num_free_blocks != kv.num_total_blocks:
            problems.append(f"KV blocks leaked: {kv.num_total_blocks - kv.num_free_blocks}")
    assert not problems, "; ".join(problems)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from specserve.config import DEFAULT_MODEL
    from specserve.model.loader import MODEL_ALIASES, resolve_model_dir

    package = MODEL_ALIASES[DEFAULT_MODEL][0]
    if importlib.util.find_spec(package) is None:  # a machine set up without it (`make test` installs it)
        pytest.skip(f"the default model's package {package.replace('_', '-')} is not installed")
    return resolve_model_dir(DEFAULT_MODEL)


def write_tiny_model(path: Path, tokenizer_dir: Path, vocab_size: int = 49152, hidden: int = 64,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                     model_type: str = "llama", with_weights: bool = True) -> Path:
    """A random Llama-family model directory in Hugging Face layout (config + safetensors)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": model_type,
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": hidden * 2,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    if with_weights:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.5 if vocab_size < 100 else 0.05)
        model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), default_model_dir)
