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

`DraftPass` runs the same network for drafting, over several requests' rows at once. This
module is the network only: the per-request KV cache and tree expansion live in
specserve.spec_decode.eagle, checkpoint files in specserve.spec_decode.heads_io.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels import layer_ops
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
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden]; cos/sin [T, 1, D/2] (or [B, T, 1, D/2]); past_k/v [B, P, Hkv, D];
        mask [B or 1, T, P+T] bool or None (causal over T, P must be 0). Returns (out, k, v),
        k rotated, [B, T, Hkv, D]."""
        b, t = x.shape[:-1]
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv, self.head_dim)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
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

    def forward(self, x, cos, sin, past_k, past_v, mask):
        a_in = x if self.input_layernorm is None else self.input_layernorm(x)
        a, k, v = self.self_attn(a_in, cos, sin, past_k, past_v, mask)
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
                mask: torch.Tensor | None = None):
        """features, embeds [B, T, hidden]; positions [T] (or [B, T]) int64; the past as
        past_k/past_v. Returns (predicted next features, new keys, new values). Drafting runs
        the same network as a `DraftPass`."""
        x = self.fc(torch.cat([embeds, features], -1))
        cos, sin = self.rotary.table(positions.reshape(-1), x.dtype)
        if positions.dim() == 2:
            cos = cos.view(*positions.shape, 1, -1)
            sin = sin.view(*positions.shape, 1, -1)
        return self.layers[0](x, cos, sin, past_k, past_v, mask)


class DraftPass:
    """The head as drafting runs it, over the rows of several requests at once: x [N, hidden]
    one request's rows after another, each request's new K/V written to its HeadKV and its
    rows attending there in place (`Segment`). The same network as EagleHead.forward, built
    from its weights: q/k/v and gate/up fused into one product each, every product a
    `linear(weight, bias)` (int8, our float32 kernel or PyTorch's: spec_decode.quant), and on
    a CPU float32 head the rotary embedding, the residual add with its norm and the MLP
    activation in one layer_ops call each. At a pass of a few rows the head's time is
    dispatches, not arithmetic (EagleHead.forward: ~1.2 ms a pass here, for ~0.3 ms of
    products)."""

    def __init__(self, head: EagleHead, linear) -> None:
        layer = head.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.num_kv, self.head_dim = attn.num_heads, attn.num_kv, attn.head_dim
        self.q_size, self.kv_size = attn.num_heads * attn.head_dim, attn.num_kv * attn.head_dim
        self.intermediate = mlp.gate_proj.out_features
        w = head.fc.weight
        biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.fc = linear(w, head.fc.bias)
        self.qkv = linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                          None if biases[0] is None else torch.cat(biases))
        self.o = linear(attn.o_proj.weight, None)
        self.gate_up = linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None)
        self.down = linear(mlp.down_proj.weight, None)
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.rotary = head.rotary
        self.fused = w.device.type == "cpu" and w.dtype == torch.float32 and layer_ops.available()

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                 segments: list[Segment]) -> torch.Tensor:
        """features, embeds [N, hidden]; positions [N] -> predicted next features [N, hidden]."""
        x = self.fc(torch.cat([embeds, features], -1))
        cos, sin = self.rotary.table(positions, x.dtype)
        qkv = self.qkv(x if self.input_norm is None else self.input_norm(x))
        if self.fused:  # q and k lead each row: rotated in place
            layer_ops.rotary_(qkv, self.heads + self.num_kv, self.head_dim, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k = q.view(-1, self.heads, self.head_dim), k.view(-1, self.num_kv, self.head_dim)
        v = v.view(-1, self.num_kv, self.head_dim)
        if not self.fused:
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        outs, at = [], 0
        for seg in segments:
            rows = slice(at, at + seg.rows)
            outs.append(_attend_in_place(q[rows], *seg.kv.write(seg.past, k[rows], v[rows]), seg.mask, seg.past))
            at += seg.rows
        a = self.o(torch.cat(outs) if len(outs) > 1 else outs[0])
        if self.fused:
            h, x = layer_ops.rms_norm(a, self.post_norm.weight, self.post_norm.eps, x)
            return x + self.down(layer_ops.silu_mul(self.gate_up(h)))
        x = x + a
        gate, up = self.gate_up(self.post_norm(x)).split(self.intermediate, -1)
        return x + self.down(F.silu(gate) * up)


def _attend_in_place(q, keys, values, mask, past: int) -> torch.Tensor:
    """q [T, H, D] against keys/values [Hkv, S, D] read in place (SDPA's grouped-query mode,
    4-D: on CPU the 3-D or repeated-K/V forms take the slow math kernel) -> [T, H*D]."""
    t = q.shape[0]
    if mask is None and t > 1:  # causal over the new entries after the past ones
        mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(past)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(t, -1)

