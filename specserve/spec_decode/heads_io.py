"""Draft-head checkpoints: the public EAGLE-1 and Medusa layouts (docs/eagle.md: "The EAGLE head",
"Medusa"), plus our restricted vocabulary: `d2t` (int64 [N]: draft index -> target token id) in
the weights when the draft scores only N frequent tokens. An EAGLE head without
`layers.0.input_layernorm.weight` (EAGLE-1) has no input norm; Medusa heads without
`{k}.{num_layers}.weight` use the target's LM head. An EAGLE-3 head (features fused from
the final hidden state and inner target layers' outputs) names those layers in config.json
("eagle_aux_layers") and adds `fuse.weight` (and `norm.weight` where its outputs are normed). Writing them:
specserve.spec_decode.training.checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specserve.model.arch import ModelArch


def _read(model_dir: Path | str, names: tuple[str, ...], prefix: str):
    """-> (config.json as a dict, the first weights file of `names` without `prefix`, d2t)."""
    model_dir = Path(model_dir)
    path = next((model_dir / n for n in names if (model_dir / n).is_file()), None)
    if path is None:
        raise ValueError(f"speculative_config: no weights ({', '.join(names)}) in {model_dir}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
    state = {k.removeprefix(prefix): v for k, v in state.items()}
    d2t = state.pop("d2t", None)
    return json.loads((model_dir / "config.json").read_text()), state, (d2t.long() if d2t is not None else None)


def _check_hidden(hidden: int, target: ModelArch, what: str) -> None:
    if hidden != target.hidden_size:
        raise ValueError(f"speculative_config: {what} have hidden size {hidden}, the target {target.hidden_size}")


def eagle_aux_layers(model_dir: Path | str) -> tuple[int, ...]:
    """The target layers an EAGLE head's features come from (config.json's "eagle_aux_layers":
    an EAGLE-3 head), () for a head of final hidden states (or no readable config: load_eagle
    says what is wrong)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return tuple(int(i) for i in cfg.get("eagle_aux_layers", ()))
    except (OSError, ValueError, TypeError):
        return ()


def load_eagle(model_dir: Path | str, target: ModelArch, max_positions: int = 8192):
    """-> (EagleHead in float32 on CPU, d2t int64 [N] or None, embed_tokens [V, hidden] or None)."""
    from specserve.spec_decode.eagle_head import EagleHead

    cfg, state, d2t = _read(model_dir, ("model.safetensors", "pytorch_model.bin"), "model.")
    arch = ModelArch.from_dict({"model_type": "llama", "vocab_size": target.vocab_size, **cfg})
    _check_hidden(arch.hidden_size, target, "the EAGLE head's layers")
    embed = state.pop("embed_tokens.weight", None)
    state.pop("lm_head.weight", None)  # drafts use the target's LM head
    head = EagleHead(arch, max_positions, fc_bias="fc.bias" in state,
                     input_norm="layers.0.input_layernorm.weight" in state,
                     aux_layers=tuple(int(i) for i in cfg.get("eagle_aux_layers", ())),
                     out_norm="norm.weight" in state)
    missing, unexpected = head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"speculative_config: EAGLE checkpoint mismatch: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    return head.float().eval(), d2t, embed


def load_medusa(model_dir: Path | str, target: ModelArch):
    """-> (MedusaHeads in float32, d2t or None). Accepts the public Medusa layout."""
    from specserve.spec_decode.medusa_heads import MedusaHeads

    cfg, state, d2t = _read(model_dir, ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors"),
                            "medusa_head.")
    num_heads = int(cfg.get("medusa_num_heads", 1 + max(int(k.split(".")[0]) for k in state)))
    num_layers = int(cfg.get("medusa_num_layers", 1))
    hidden = state["0.0.linear.weight"].shape[1]
    _check_hidden(hidden, target, "Medusa heads")
    vocab = state[lm].shape[0] if (lm := f"0.{num_layers}.weight") in state else 0  # 0: the target's LM head
    heads = MedusaHeads(num_heads, num_layers, hidden, vocab)
    heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return heads.float().eval(), d2t
