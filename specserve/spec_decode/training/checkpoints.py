"""Writing trained draft heads in the layouts specserve.spec_decode.heads_io reads: EAGLE-1
(config.json + model.safetensors, our `d2t` for a restricted vocabulary) and Medusa
(config.json + medusa_lm_head.safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_eagle(head, d2t: torch.Tensor | None, out_dir: Path | str, dtype=torch.float16,
               extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    a = head.arch
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
           "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
           "head_dim": a.head_dim, "num_hidden_layers": 1, "rms_norm_eps": a.rms_norm_eps,
           "rope_theta": a.rope_theta, "vocab_size": a.vocab_size,
           "max_position_embeddings": a.max_position_embeddings, "tie_word_embeddings": False,
           "bias": head.fc.bias is not None, **(extra or {})}
    if d2t is not None:
        cfg["draft_vocab_size"] = int(d2t.numel())
    if head.aux_layers:
        cfg["eagle_aux_layers"] = list(head.aux_layers)
    state = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    if d2t is not None:
        state["d2t"] = d2t.to(torch.int64).contiguous()
    tmp = out_dir / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def save_medusa(heads, d2t: torch.Tensor | None, out_dir: Path | str, dtype=torch.float16) -> None:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    if d2t is not None:
        state["d2t"] = d2t.to(torch.int64).contiguous()
    save_file(state, str(out_dir / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    cfg = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
           "hidden_size": heads.hidden_size}
    if d2t is not None:
        cfg["draft_vocab_size"] = int(d2t.numel())
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
