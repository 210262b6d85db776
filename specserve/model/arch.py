"""The shape of a Llama-family decoder, read from a Hugging Face config.json.

One record covers Llama 2/3, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm) and SmolLM.
Architectures outside that family are refused with a clear error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "smollm", "smollm3"}


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @staticmethod
    def from_dict(cfg: dict) -> "ModelArch":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model: architecture {model_type!r} is not supported "
                             f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelArch(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if rope_type not in ("default", None) else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @staticmethod
    def from_dir(model_dir: Path) -> "ModelArch":
        return ModelArch.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))
