"""The EAGLE draft head: one decoder layer over (target feature, next-token embedding).

EAGLE (Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", 2024)
drafts at the feature level. For a sequence x_0..x_n with target features f_0..f_{n-1} (the
final hidden states after the last norm, i.e. the LM head's input; f_t predicts x_{t+1}), the
head reads the pair (f_t, x_{t+1}) at position t and predicts f_{t+1}:

    h = fc(concat(embed(x_{t+1}), f_t))          # 2*hidden -> hidden
    h = h + attn(h)                              # layer 0 has no input norm (EAGLE-1)
    f_hat_{t+1} = h + mlp(post_attention_layernorm(h))

and the target's own LM head turns f_hat into draft logits (no final norm). Parameter names
follow the public EAGLE-1 checkpoint layout (`fc.*`, `layers.0.self_attn.q_proj.weight`, ...),
so `state_dict()` of this module is such a checkpoint.

This module is the network only: the per-request KV cache and tree expansion live in
specserve.spec_decode.eagle, checkpoint files in specserve.spec_decode.heads_io.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.arch import ModelArch
from specserve.model.llama import RMSNorm, RotaryEmbedding


class HeadKV:
    """One request's head K/V for drafting, heads-major ([Hkv, capacity, D], grown by doubling)
    so that attention reads the past without copying it. Entry i is pair i; the entries past
    the committed pairs hold the tree being drafted, overwritten next time."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [T, Hkv, D] for entries start .. start + T - 1 -> keys and values of entries
        0 .. start + T - 1, [Hkv, start + T, D] each (views of the buffers)."""
        end = start + k.shape[0]
        if self.k is None or self.k.shape[1] < end:
            shape = (k.shape[1], max(64, 2 * end), k.shape[2])
            grown_k, grown_v = k.new_empty(shape), v.new_empty(shape)
            if self.k is not None:
                grown_k[:, :start] = self.k[:, :start]
                grown_v[:, :start] = self.v[:, :start]
            self.k, self.v = grown_k, grown_v
        self.k[:, start:end] = k.transpose(0, 1)
        self.v[:, start:end] = v.transpose(0, 1)
        return self.k[:, :end], self.v[:, :end]


class Segment(NamedTuple):
    """The rows of one request in a drafting pass: written into `kv` from entry `past` on; each
    row sees the entries `mask` allows ([T, past + T] bool; None: all past entries and the
    new rows causally)."""
    kv: HeadKV
    past: int
    rows: int
    mask: torch.Tensor | None


class HeadAttention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        h = arch.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past_k: torch.Tensor | None, past_v: torch.Tensor | None,
                mask: torch.Tensor | None, segments: list[Segment] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Training: x [B, T, hidden]; cos/sin [T, 1, D/2] (or [B, T, 1, D/2]); past_k/v
        [B, P, Hkv, D]; mask [B or 1, T, P+T] bool or None (causal over T, P must be 0).
        Drafting (`segments`): x [N, hidden], the rows of several requests one after another,
        cos/sin [N, 1, D/2]; each request's new K/V go to its HeadKV and its rows attend there.
        Returns (out, k, v) with k rotated ([B, T, Hkv, D], or [N, Hkv, D] drafting)."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv, self.head_dim)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        if segments is not None:
            outs, at = [], 0
            for seg in segments:
                rows = slice(at, at + seg.rows)
                outs.append(self._attend_in_place(q[rows], *seg.kv.write(seg.past, k[rows], v[rows]),
                                                  seg.mask, seg.past))
                at += seg.rows
            return self.o_proj(torch.cat(outs)), k, v
        b, t = lead
        keys = k if past_k is None else torch.cat([past_k, k], 1)
        values = v if past_v is None else torch.cat([past_v, v], 1)
        group = self.num_heads // self.num_kv
        qh = q.transpose(1, 2)  # [B, H, T, D]
        kh = keys.transpose(1, 2).repeat_interleave(group, 1)
        vh = values.transpose(1, 2).repeat_interleave(group, 1)
        if mask is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), k, v

    def _attend_in_place(self, q, keys, values, mask, past: int) -> torch.Tensor:
        """q [T, H, D] against keys/values [Hkv, S, D] read in place (SDPA's grouped-query
        mode, 4-D: on CPU the 3-D or repeated-K/V forms take the slow math kernel) -> [T, H*D]."""
        t = q.shape[0]
        if mask is None and t > 1:  # causal over the new entries after the past ones
            mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(past)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(t, -1)


class HeadMLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HeadLayer(nn.Module):
    def __init__(self, arch: ModelArch, input_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if input_norm else None
        self.self_attn = HeadAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = HeadMLP(arch)

    def forward(self, x, cos, sin, past_k, past_v, mask, segments=None):
        a_in = x if self.input_layernorm is None else self.input_layernorm(x)
        a, k, v = self.self_attn(a_in, cos, sin, past_k, past_v, mask, segments)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class EagleHead(nn.Module):
    """fc + one decoder layer. `arch` is the head's own config (a LlamaConfig with one layer)."""

    def __init__(self, arch: ModelArch, max_positions: int = 8192, fc_bias: bool = True,
                 input_norm: bool = False) -> None:
        super().__init__()
        self.arch = arch
        h = arch.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([HeadLayer(arch, input_norm)])
        self.rotary = RotaryEmbedding(arch, max_positions)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, segments: list[Segment] | None = None):
        """Training: features, embeds [B, T, hidden]; positions [T] (or [B, T]) int64; the past
        as past_k/past_v. Drafting: features, embeds [N, hidden], positions [N], the rows of
        several requests by `segments` (HeadAttention). Returns (predicted next features, new
        keys, new values)."""
        x = self.fc(torch.cat([embeds, features], -1))
        cos, sin = self.rotary.table(positions.reshape(-1), x.dtype)
        if positions.dim() == 2:
            cos = cos.view(*positions.shape, 1, -1)
            sin = sin.view(*positions.shape, 1, -1)
        return self.layers[0](x, cos, sin, past_k, past_v, mask, segments)

