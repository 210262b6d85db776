"""The EAGLE draft head: one decoder layer over (target feature, next-token embedding), read at
position t as the pair (f_t, x_{t+1}) and predicting f_{t+1} (docs/eagle.md):

    h = fc(concat(embed(x_{t+1}), f_t))          # 2*hidden -> hidden
    h = h + attn(h)                              # layer 0 has no input norm (EAGLE-1)
    f_hat_{t+1} = h + mlp(post_attention_layernorm(h))

and the target's own LM head turns f_hat into draft logits. `EagleHead` holds the parameters
in the public EAGLE-1 checkpoint layout (`fc.*`, `layers.0.self_attn.q_proj.weight`, ...);
`DraftPass` is the network, as drafting runs it over several requests' rows at once and as
training runs it (EagleHead.forward). The per-request cache and tree expansion live in
specserve.spec_decode.eagle, checkpoint files in specserve.spec_decode.heads_io.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specserve.kernels.cpu import layer_ops
from specserve.model.arch import ModelArch
from specserve.model.llama import RMSNorm, RotaryEmbedding, packed_product


# SDPA backends for drafting on CUDA: every drafting call has a new key length (the past grows,
# trees differ), and cuDNN's attention builds an execution plan per new shape (milliseconds
# each), which PyTorch may pick for bfloat16 on Hopper; the others run any shape as it comes
DRAFT_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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


class HeadKVPool:
    """Every request's head K/V in one pair of tensors, token-major ([slots, Hkv, D], grown by
    doubling), handed out in blocks of BLOCK entries (`PooledKV`), so that a drafting pass writes
    the new entries of all its requests in one call and reads their contexts in one gather
    (`_attend_pooled`): a pass costs a fixed number of launches, not a few per request, which
    is what a GPU's drafting time is made of at several requests."""

    BLOCK = 16

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = torch.zeros(64 * self.BLOCK, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.free = list(range(63, -1, -1))  # block ids, the next one handed out last

    def new(self) -> "PooledKV":
        return PooledKV(self)

    def take(self) -> int:
        if not self.free:  # double: the old entries keep their slots
            n = self.k.shape[0] // self.BLOCK
            self.k = torch.cat([self.k, torch.zeros_like(self.k)])
            self.v = torch.cat([self.v, torch.zeros_like(self.v)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0] // self.BLOCK


class PooledKV:
    """One request's head K/V in a HeadKVPool: entry i lives in slot blocks[i // BLOCK] * BLOCK +
    i % BLOCK. Its blocks go back to the pool when it is dropped (a request's cache let go,
    restarted or freed)."""

    def __init__(self, pool: HeadKVPool) -> None:
        self.pool, self.blocks = pool, []

    def slots(self, start: int, end: int) -> np.ndarray:
        """Slots of entries start .. end - 1 (blocks taken as needed)."""
        bs = self.pool.BLOCK
        while len(self.blocks) * bs < end:
            self.blocks.append(self.pool.take())
        i = np.arange(start, end)
        return np.asarray(self.blocks, dtype=np.int64)[i // bs] * bs + i % bs

    def slot_list(self, start: int, end: int) -> list[int]:
        """`slots` as a list (blocks taken as needed)."""
        bs = self.pool.BLOCK
        while len(self.blocks) * bs < end:
            self.blocks.append(self.pool.take())
        blocks = self.blocks
        return [blocks[i // bs] * bs + i % bs for i in range(start, end)]

    def __del__(self) -> None:
        self.pool.free.extend(reversed(self.blocks))
        self.blocks = []


class Segment(NamedTuple):
    """The rows of one request in a drafting pass: written into `kv` from entry `past` on; each
    row sees the entries `mask` allows ([T, past + T] bool; None: all past entries and the
    new rows causally; with a PooledKV, on the CPU)."""
    kv: HeadKV | PooledKV
    past: int
    rows: int
    mask: torch.Tensor | None


def _linears(**shapes: tuple[int, int, bool]) -> nn.Module:
    """A container of nn.Linear layers by name, each (in features, out features, bias)."""
    module = nn.Module()
    for name, (n_in, n_out, bias) in shapes.items():
        setattr(module, name, nn.Linear(n_in, n_out, bias=bias))
    return module


class EagleHead(nn.Module):
    """fc + one decoder layer. `arch` is the head's own config (a LlamaConfig with one layer).

    With `aux_layers` (an EAGLE-3 head) the head's feature f_t is `fuse` of the target's final
    hidden state and the outputs of those inner target layers (fuse(concat(f_t, a_t, b_t)):
    low, middle and high level at once). With `out_norm` its outputs pass through its own
    `norm` before the target's LM head, and it is trained on the draft distribution alone (no
    feature regression: an output need not look like a target feature); without, the outputs
    stay predicted features (a head grown from an EAGLE-2 one: train.py --init)."""

    def __init__(self, arch: ModelArch, max_positions: int = 8192, fc_bias: bool = True,
                 input_norm: bool = False, aux_layers: tuple[int, ...] = (), out_norm: bool = False) -> None:
        super().__init__()
        self.arch = arch
        h, inter, bias = arch.hidden_size, arch.intermediate_size, arch.qkv_bias
        self.aux_layers = tuple(aux_layers)
        self.fuse = nn.Linear((1 + len(aux_layers)) * h, h, bias=False) if aux_layers else None
        self.norm = RMSNorm(h, arch.rms_norm_eps) if out_norm else None
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        layer = nn.Module()
        layer.input_layernorm = RMSNorm(h, arch.rms_norm_eps) if input_norm else None
        layer.self_attn = _linears(q_proj=(h, q, bias), k_proj=(h, kv, bias), v_proj=(h, kv, bias),
                                   o_proj=(q, h, False))
        layer.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps)
        layer.mlp = _linears(gate_proj=(h, inter, False), up_proj=(h, inter, False), down_proj=(inter, h, False))
        self.layers = nn.ModuleList([layer])
        self.rotary = RotaryEmbedding(arch, max_positions)

    def fuse_input(self, features: torch.Tensor) -> torch.Tensor:
        """[..., (1 + layers) * hidden]: the final hidden states, then the inner layers' outputs
        -> fuse's input: the final hidden states as they are, each inner layer's output scaled to
        unit RMS per token (the residual stream grows with depth, with outliers of 1e4 at a few
        tokens and channels, which would swamp the fusion)."""
        h = self.arch.hidden_size
        inner = features[..., h:].unflatten(-1, (-1, h))
        scale = torch.rsqrt(inner.float().pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps)
        return torch.cat([features[..., :h], (inner * scale.to(inner.dtype)).flatten(-2)], -1)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                mask: torch.Tensor | None = None):
        """Training's batched form: features, embeds [B, T, hidden]; positions [T] (or [B, T])
        int64; past_k/past_v [B, P, Hkv, D]; mask [B or 1, T, P + T] bool, or None (causal, no
        past). Returns (predicted next features [B, T, hidden], the new rotated keys and values
        [B, T, Hkv, D]). The network drafting runs (`DraftPass.run`), with PyTorch's products."""
        b, t, _ = features.shape
        new: list[torch.Tensor] = []

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = k.view(b, t, *k.shape[1:]), v.view(b, t, *v.shape[1:])
            new.extend((k, v))
            if past_k is not None:
                k, v = torch.cat([past_k, k], 1), torch.cat([past_v, v], 1)
            out = F.scaled_dot_product_attention(q.view(b, t, *q.shape[1:]).transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), None if mask is None else mask[:, None],
                                                 is_causal=mask is None, enable_gqa=True)
            return out.transpose(1, 2).reshape(b * t, -1)

        network = DraftPass(self, lambda w, bias: partial(F.linear, weight=w, bias=bias), fused=False)
        out = network.run(features.flatten(0, 1), embeds.flatten(0, 1), positions.expand(b, t).flatten(), attend)
        return out.view(b, t, -1), *new


class DraftPass:
    """The head as drafting runs it, over the rows of several requests at once, each request's
    new K/V written to its HeadKV and its rows attending there in place (`Segment`). Built from
    the head's weights: q/k/v and gate/up fused into one product each, every product a
    `linear(weight, bias)` (spec_decode.quant), and on a CPU float32 head the rotary, the
    residual add with its norm and the MLP activation one layer_ops call each (`fused`); where
    all of it is our kernels, given the token embeddings (`embed`), the whole pass one C call
    over a HeadKVPool (`tokens`, `c_pass`). Training runs the same network (`run`) through
    EagleHead.forward."""

    def __init__(self, head: EagleHead, linear, fused: bool | None = None, embed: torch.Tensor | None = None) -> None:
        layer, arch = head.layers[0], head.arch
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.num_kv, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.num_kv * self.head_dim
        self.intermediate = arch.intermediate_size
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
        self.fused = (w.device.type == "cpu" and w.dtype == torch.float32 and layer_ops.available()
                      if fused is None else fused)
        self.embed = embed
        self.c_pass = self._c_pass() if embed is not None and self.fused else None

    def _c_pass(self):
        """The pass as one C call (specserve.kernels.cpu.decoder.HeadPass), or None where a
        part of it is not our kernels: a product that is not a cpu_linear kernel (PyTorch's
        GEMM, int8 weights up to a row count), a norm of its own eps, attention our paged
        kernel does not cover."""
        from specserve.kernels.cpu import cpu_attention, decoder

        products = [packed_product(f) for f in (self.fc, self.qkv, self.o, self.gate_up, self.down)]
        norms = [n for n in (self.input_norm, self.post_norm) if n is not None]
        cos, sin = self.rotary.cos, self.rotary.sin
        if (None in products or not decoder.available() or self.embed.dtype != torch.float32
                or any(type(n) is not RMSNorm or n.eps != self.post_norm.eps for n in norms)
                or cos.dtype != torch.float32
                or not cpu_attention.supports(self.heads, self.num_kv, self.head_dim, torch.float32)):
            return None
        return decoder.HeadPass(products, None if self.input_norm is None else self.input_norm.weight.data,
                                self.post_norm.weight.data, self.embed.contiguous(), cos.contiguous(),
                                sin.contiguous(), self.heads, self.num_kv, self.head_dim, self.intermediate,
                                self.post_norm.eps)

    def tokens(self, features: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
               segments: list[Segment]) -> torch.Tensor:
        """As a call with the rows' next tokens [N] int64 for their embeddings (the `embed` the
        pass was built with): segments of a HeadKVPool run as one C call where the pass has one
        (`c_pass`), the others as a call."""
        if self.c_pass is not None and isinstance(segments[0].kv, PooledKV):
            pool = segments[0].kv.pool
            meta = _paged_meta(segments)  # (first: the pool may grow for the new entries)
            shape = (pool.num_blocks, pool.BLOCK, *pool.k.shape[1:])
            return self.c_pass(features, ids, positions, pool.k.view(shape), pool.v.view(shape), meta)
        return self(features, self.embed.index_select(0, ids), positions, segments)

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                 segments: list[Segment]) -> torch.Tensor:
        """features, embeds [N, hidden]; positions [N] -> predicted next features [N, hidden].
        Segments of PooledKV attend through their pool in one call, of HeadKV each in place."""
        pooled = isinstance(segments[0].kv, PooledKV)
        attend = partial(_attend_pooled if pooled else _attend_in_place, segments)
        if features.device.type != "cuda":
            return self.run(features, embeds, positions, attend)
        with sdpa_kernel(DRAFT_SDPA_BACKENDS):
            return self.run(features, embeds, positions, attend)

    def run(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The network over rows [N, hidden], `attend(q [N, H, D], k, v [N, Hkv, D])` giving the
        attention's output rows [N, H * D]."""
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
        a = self.o(attend(q, k, v))
        if self.fused:
            h, x = layer_ops.rms_norm(a, self.post_norm.weight, self.post_norm.eps, x)
            return x + self.down(layer_ops.silu_mul(self.gate_up(h)))
        x = x + a
        gate, up = self.gate_up(self.post_norm(x)).split(self.intermediate, -1)
        return x + self.down(F.silu(gate) * up)


def _attend_pooled(segments: list[Segment], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D]: every segment's new entries written to the pool at once (one
    call for K, one for V), every segment's rows attending to its entries as one padded batch
    ([S, H, T, D] queries over [S, Hkv, L, D] keys gathered from the pool, padding masked) ->
    [N, H*D]. The indices and the mask are built on the host and cross in one copy."""
    pool = segments[0].kv.pool
    n, heads, dim = q.shape
    num, rows = len(segments), max(seg.rows for seg in segments)
    width = -(-max(seg.past + seg.rows for seg in segments) // 8) * 8  # (the mask's rows aligned)
    new_slots, ctx = np.empty(n, np.int64), np.zeros((num, width), np.int64)
    q_rows, out_rows = np.full((num, rows), n, np.int64), np.empty(n, np.int64)
    mask = np.zeros((num, rows, width), np.bool_)
    mask[:, :, 0] = True  # a padding row sees one entry (no row of -inf), its output unread
    at = 0
    for b, seg in enumerate(segments):
        t, past = seg.rows, seg.past
        slots = seg.kv.slots(0, past + t)
        new_slots[at:at + t], ctx[b, :past + t] = slots[past:], slots
        q_rows[b, :t] = np.arange(at, at + t)
        out_rows[at:at + t] = b * rows + np.arange(t)
        if seg.mask is None:  # the past, then the new rows causally
            mask[b, :t, :past + t] = np.arange(past + t)[None, :] <= past + np.arange(t)[:, None]
        else:
            mask[b, :t, :past + t] = seg.mask.numpy()
        at += t
    index = np.concatenate([new_slots, ctx.ravel(), q_rows.ravel(), out_rows])
    raw = torch.from_numpy(np.concatenate([index.view(np.uint8), mask.view(np.uint8).ravel()]))
    if q.device.type != "cpu":
        raw = raw.to(q.device, non_blocking=True)
    cut = index.nbytes  # (the int64 indices first: 8-byte aligned)
    mask_t = raw[cut:].view(torch.bool).view(num, rows, width)
    new_slots, ctx, q_rows, out_rows = raw[:cut].view(torch.int64).split([n, num * width, num * rows, n])
    pool.k.index_copy_(0, new_slots, k)
    pool.v.index_copy_(0, new_slots, v)
    keys = pool.k[ctx].view(num, width, *k.shape[1:]).transpose(1, 2)  # [S, Hkv, L, D]
    values = pool.v[ctx].view(num, width, *v.shape[1:]).transpose(1, 2)
    queries = torch.cat([q, q.new_zeros(1, heads, dim)])[q_rows].view(num, rows, heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask_t[:, None], enable_gqa=True)
    return out.transpose(1, 2).reshape(num * rows, heads * dim)[out_rows]


def _paged_meta(segments: list[Segment]) -> tuple:
    """The paged attention kernel's metadata (specserve.kernels.cpu.cpu_attention) for segments
    of a HeadKVPool: the new entries' slots (blocks taken as needed), each segment's rows in
    runs of at most MAX_ROWS over its block table, and each row's visible entries as the
    kernel counts them: a causal row those up to its own; a masked one the leading run of
    entries its mask allows, then the others it allows (a tree node's ancestors and itself).
    -> specserve.kernels.cpu.decoder.HeadPass's `meta`. In Python lists, one tensor made of
    them: a drafting pass has a few rows, where numpy's calls per row cost more than the
    pass's attention."""
    from specserve.kernels.cpu.cpu_attention import MAX_ROWS

    tables, starts, dense, ptr, extra, slots = [], [0], [], [0], [], []
    for seg in segments:
        t, past = seg.rows, seg.past
        slots += seg.kv.slot_list(past, past + t)
        if seg.mask is None:
            dense += range(past + 1, past + t + 1)
            ptr += [ptr[-1]] * t
        else:
            width = seg.mask.shape[1]
            raw = seg.mask.numpy().tobytes()
            for j in range(0, len(raw), width):
                row = raw[j:j + width]
                lead = row.find(0)
                lead = width if lead < 0 else lead
                extra += [lead + i for i, seen in enumerate(row[lead:]) if seen]
                dense.append(lead)
                ptr.append(len(extra))
        for first in range(0, t, MAX_ROWS):
            tables.append(seg.kv.blocks)
            starts.append(starts[-1] + min(MAX_ROWS, t - first))
    width = max(map(len, tables))
    flat = torch.tensor(starts + dense + ptr + slots
                        + [b for blocks in tables for b in blocks + [0] * (width - len(blocks))] + extra)
    return flat, len(tables), width, max(d + ptr[i + 1] - ptr[i] for i, d in enumerate(dense))


def _attend_in_place(segments: list[Segment], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D]: each segment's rows written to its HeadKV and attending
    there in place (SDPA's grouped-query mode, 4-D: on CPU the 3-D or repeated-K/V forms take
    the slow math kernel) -> [N, H*D]."""
    outs, at = [], 0
    for seg in segments:
        t, past, mask = seg.rows, seg.past, seg.mask
        keys, values = seg.kv.write(past, k[at:at + t], v[at:at + t])
        if mask is None and t > 1:  # causal over the new entries after the past ones
            mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(past)
        out = F.scaled_dot_product_attention(q[at:at + t].transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=mask, enable_gqa=True)
        outs.append(out[0].transpose(0, 1).reshape(t, -1))
        at += t
    return torch.cat(outs) if len(outs) > 1 else outs[0]
