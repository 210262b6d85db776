"""Llama-family decoder over a flattened batch of tokens with paged attention.

The model takes the concatenated new tokens of many requests (no padding), their absolute
positions (rotary embeddings are per token) and the step's AttentionMetadata. Parameter names
follow Hugging Face's so checkpoints load by name; q/k/v and gate/up projections are fused at
load time (one matmul each), which is what makes the CPU path fast.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.cpu import layer_ops
from specserve.kernels.triton.rms_norm import rms_norm_ref
from specserve.model.arch import ModelArch
from specserve.model.attention import AttentionMetadata
from specserve.model.attention.cpu_paged import CPUPagedMetadata


def packed_product(f):
    """The cpu_linear kernel (`_Packed`, any format) a product runs, for a caller in C
    (kernels/cpu/decoder.c) to call: a `_Packed` itself, a model Linear's or an Int8Linear's;
    None for anything else (PyTorch's GEMM, a tensor-parallel shard, a product switching
    kernels by row count)."""
    from specserve.kernels.cpu.cpu_linear import _Packed
    from specserve.model.quant import Int8Linear

    kernel = (getattr(f, "packed", None) if type(f) is Linear
              else getattr(f, "kernel", None) if type(f) is Int8Linear else f)
    return kernel if isinstance(kernel, _Packed) else None


class Linear(nn.Linear):
    """nn.Linear that can route its products through our CPU kernel, or one-row inputs
    through the many-row GEMM.

    `packed` (CPU float32 where our kernel builds, see `finalize_weights`): the weights live
    only in specserve.kernels.cpu.cpu_linear's layout and every product goes through our
    kernel, which gives a row the same bits whatever the batch. A single row through oneDNN's
    bfloat16 GEMM takes a GEMV path whose sums differ in the last bit now and then from the
    same row among others (seen for reduction lengths of 1536 and more). `finalize_weights`
    sets `pad_single_row` for the CPU bfloat16 model, so a one-token decode step computes
    what the same token gets inside a small verification batch; the extra row costs nothing
    measurable (the weights are read once either way). Beyond that oneDNN's bfloat16 GEMM is
    not batch-invariant on every CPU (docs/cpu.md).
    """

    pad_single_row = False
    rows_per_call = 0  # CPU, --batch-invariant: PyTorch's products in calls of at most this many rows
    packed = None  # a cpu_linear.PackedFloat32 or PackedA8, see finalize_weights and use_gguf_products
    invariant = False  # through specserve::linear_invariant (CUDA, --batch-invariant): see use_invariant_products

    def pack(self, a8: bool = False) -> None:
        """Move the weights into our kernel's layout, in GGUF's Q4_1 or Q8_0 blocks where
        they are exactly such blocks (cpu_linear.pack_float32); the dense copy is dropped.
        a8: for products with int8 activations instead (cpu_linear.pack_a8, `--quantization gguf`)."""
        from specserve.kernels.cpu.cpu_linear import pack_a8, pack_float32

        self.packed = (pack_a8 if a8 else pack_float32)(self.weight, self.bias)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        if self.invariant:
            return torch.ops.specserve.linear_invariant(x, self.weight, self.bias)
        n = self.rows_per_call
        if n and x.shape[0] > n:
            return torch.cat([self.dense(x[i:i + n]) for i in range(0, x.shape[0], n)])
        return self.dense(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The product through PyTorch's GEMM in one call (one row padded to two: see the class)."""
        if self.pad_single_row and x.shape[0] == 1:
            return F.linear(torch.cat((x, x)), self.weight, self.bias)[:1]
        return F.linear(x, self.weight, self.bias)


def invariant_call_rows(linears: list[Linear], most: int = 64) -> int:
    """The most rows (up to `most`) a call of PyTorch's product may take on this CPU for each
    of its rows to get the bits the row gets alone, for every product shape among `linears`:
    a call of m rows is compared, row for row, with each row alone, for m = 2, 3, ... at the
    start and at the end of `most` random rows, up to the first m that differs. oneDNN's
    bfloat16 GEMM picks its kernel by the number of rows (on an AMX Xeon calls of 1 to 32 rows
    gave every row its bits alone, 33 rows and more others; docs/cpu.md), and on another CPU
    at other sizes, so the size is found where the engine runs (1.6 s for the default model
    on that Xeon; once per process for each set of shapes)."""
    shapes = {(tuple(lin.weight.shape), lin.bias is not None, lin.weight.dtype): lin
              for lin in linears if lin.weight.numel()}
    key = (tuple(sorted(shapes, key=str)), most, torch.get_num_threads())
    if key not in _CALL_ROWS:
        _CALL_ROWS[key] = _measure_call_rows(list(shapes.values()), most)
    return _CALL_ROWS[key]


_CALL_ROWS: dict[tuple, int] = {}  # invariant_call_rows' answers in this process


def _measure_call_rows(linears: list[Linear], most: int) -> int:
    gen = torch.Generator().manual_seed(0)
    best = most
    with torch.inference_mode():
        for lin in linears:
            x = torch.randn(most, lin.in_features, generator=gen).to(lin.weight.dtype)
            alone = torch.cat([lin.dense(x[i:i + 1]) for i in range(most)])
            for m in range(2, best + 1):
                if not (torch.equal(lin.dense(x[:m]), alone[:m]) and torch.equal(lin.dense(x[-m:]), alone[-m:])):
                    best = m - 1
                    break
    return best


class RMSNorm(nn.Module):
    fused = False  # specserve.kernels.cpu.layer_ops for `add`: see LlamaForCausalLM.use_layer_ops
    invariant = False  # through specserve::rms_norm_invariant (CUDA, --batch-invariant): see use_invariant_products

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) with s = x + residual, or x itself when there is no residual yet."""
        if self.fused:
            return layer_ops.rms_norm(x, self.weight, self.eps, residual)
        if self.invariant and residual is not None:
            return torch.ops.specserve.add_rms_norm_invariant(x, residual, self.weight, self.eps)
        total = x if residual is None else x + residual
        return self(total), total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return torch.ops.specserve.rms_norm_invariant(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # the same bits, one call
        return rms_norm_ref(x, self.weight, self.eps)


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    dim = arch.head_dim
    # float32 like Hugging Face, so positions rotate identically
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, scaled))
    elif kind not in (None, "default"):
        raise ValueError(f"model: rope scaling {kind!r} is not supported")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a precomputed cos/sin table."""

    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(arch))
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions: [T, 1, D/2] each, computed once per forward."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = self.head_dim ** -0.5
        self.fused_rotary = False  # see LlamaForCausalLM.use_layer_ops
        self.invariant = False  # q and k rotated in one launch (--batch-invariant): see use_invariant_products

    def forward(self, x, positions, rotary, kv_cache, meta: AttentionMetadata, backend):
        qkv = self.qkv_proj(x)
        if self.fused_rotary:  # q and k lead each row of qkv: rotated in place, in one call
            layer_ops.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rotary)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.invariant and self.q_norm is None:  # q's and k's heads lead each row of qkv
            qk = torch.ops.specserve.rotary_invariant(qkv, *rotary, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if not self.fused_rotary:
                q, k = RotaryEmbedding.apply(q, *rotary), RotaryEmbedding.apply(k, *rotary)
        out = backend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.intermediate = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.fused = False  # silu(gate) * up in one layer_ops call: see LlamaForCausalLM.use_layer_ops
        self.invariant = False  # the same in one Triton launch (--batch-invariant): see use_invariant_products

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(layer_ops.silu_mul(self.gate_up_proj(x)))
        if self.invariant:
            return self.down_proj(torch.ops.specserve.silu_mul_invariant(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_idx)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, residual, positions, rotary, kv_cache, meta, backend):
        """-> (this layer's MLP output, the residual stream before it): the next norm adds the
        two (one call with the fused norm; the same sums as x + attn, x + mlp)."""
        h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(
            self.self_attn(h, positions, rotary, kv_cache, meta, backend), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(arch, max_positions)
        self.lm_head_t: torch.Tensor | None = None  # see finalize_weights
        self.invariant_rows = 0  # CPU, --batch-invariant: the most rows of a product's call (use_invariant_call_rows)
        self.lm_head_kernel = None  # the LM head through our CPU kernel: see quantize_int8, finalize_weights
        self.argmax_head = None  # greedy rows' LM head (cpu_linear.ArgmaxHead): see finalize_weights
        # decoder layers whose outputs (the residual stream after them) the forward also returns,
        # after the final hidden states: an EAGLE-3 head's fused features (spec_decode/eagle.py)
        self.aux_layers: tuple[int, ...] = ()
        self.decoder = None  # every layer in one C call (CPU float32): see use_layer_ops

    @property
    def output_width(self) -> int:
        """Columns of forward's output: the final hidden state, then each aux layer's output."""
        return self.arch.hidden_size * (1 + len(self.aux_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend, layer_fn=None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (after the last norm),
        followed by the outputs of `aux_layers` when there are any ([T, output_width]).
        layer_fn(layer, x, residual, ...): runs each decoder layer (the compiled step's
        compiled DecoderLayer.forward, model/compiled.py), else the layer itself."""
        x = self.embed_tokens(input_ids)
        rotary = self.rotary.table(positions, x.dtype)
        if self.decoder is not None and layer_fn is None and type(meta) is CPUPagedMetadata:
            return self.decoder(x, *rotary, kv_caches, meta, self.aux_layers)
        residual = None
        aux = []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if layer_fn is None:
                x, residual = layer(x, residual, positions, rotary, kv_cache, meta, backend)
            else:
                x, residual = layer_fn(layer, x, residual, positions, rotary, kv_cache, meta, backend)
            if i in self.aux_layers:
                aux.append(x + residual)  # (the next norm makes the same sum)
        final = self.norm.add(x, residual)[0]
        return torch.cat([final, *aux], -1) if aux else final

    def compute_logits(self, hidden: torch.Tensor, argmax_only: list[bool] | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32. argmax_only: per row, whether its argmax is
        all that is read of it (greedy, nothing changing its logits, no logprobs); such rows go
        through `argmax_head` where there is one: the same argmax, the other values close."""
        if self.argmax_head is not None and argmax_only is not None and any(argmax_only):
            if all(argmax_only):
                return self.argmax_head(hidden)
            pick = torch.tensor(argmax_only)
            out = torch.empty(hidden.shape[0], self.argmax_head.out_features)
            out[pick] = self.argmax_head(hidden[pick])
            out[~pick] = self.lm_head_kernel(hidden[~pick])
            return out
        if self.lm_head_kernel is not None:
            return self.lm_head_kernel(hidden).float()  # Int8Linear answers in the model's dtype
        if self.lm_head_t is not None:
            return (hidden @ self.lm_head_t).float()
        return self.lm_head(hidden).float()

    def quantize_int8(self) -> None:
        """`--quantization int8`: every projection of every layer and the LM head in int8
        (specserve.model.quant.Int8Linear over our batch-invariant CPU kernel). The embedding
        stays in the model's dtype (a lookup reads one row), and so does `lm_head.weight`,
        which draft heads read (tied models share it with the embedding: no extra bytes)."""
        from specserve.model.quant import Int8Linear, quantize_linears

        quantize_linears(self.layers)
        self.lm_head_kernel = Int8Linear.from_linear(self.lm_head)

    def use_gguf_products(self) -> None:
        """`--quantization gguf`: every projection of every layer and the LM head through
        specserve.kernels.cpu.cpu_linear.pack_a8 (int8 activations per block of 32 against the
        GGUF's Q4_1 / Q8_0 blocks; weights that are not such blocks become Q8_0 blocks), each
        row's bits independent of the batch. The embedding stays float32, and so does
        `lm_head.weight`, which draft heads read. AVX512-VNNI or AVX2, as measured here. Runs
        before finalize_weights, which then finds the products packed and leaves them."""
        from specserve.kernels.cpu import cpu_linear
        from specserve.model.quant import pick_a8_vnni

        pick_a8_vnni(self._pack_products(cpu_linear.pack_a8, a8=True))

    def _pack_products(self, pack_head, a8: bool = False) -> list:
        """The LM head through pack_head(weight, None) (its weight stays: draft heads read it)
        and every layer's products packed (`Linear.pack`); returns the layers' q/k/v and gate/up
        products, what the start-up choices of an instruction set time."""
        self.lm_head_kernel = pack_head(self.lm_head.weight.detach(), None)
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.pack(a8)
        return [m.packed for layer in self.layers for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]

    def use_invariant_products(self) -> None:
        """Every product, the LM head's too, and every norm through the batch-invariant kernels
        (specserve::linear_invariant, specserve::rms_norm_invariant, model/invariant_ops.py): a
        row's bits then never depend on the rows beside it, which cuBLAS's choice of kernel by
        row count and PyTorch's (or the compiler's) split of a row's reduction do not give.
        The residual adds go with the norms, and rotary and SiLU x up take one launch each
        (elementwise, so invariant either way): a layer's arithmetic is then all inside
        registered ops, which the compiled step computes exactly as the eager one does."""
        import specserve.model.invariant_ops  # noqa: F401 (registers the ops)

        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm, Attention, MLP)):
                module.invariant = True
        self.lm_head_t = None  # (the LM head through its Linear)

    def use_invariant_call_rows(self) -> None:
        """On a CPU, the products that go through PyTorch's GEMM (bfloat16 and float16, and
        float32 where our kernel does not run) in calls of at most `invariant_call_rows` rows,
        so that a row's bits never depend on the rows beside it: a verify row is then the
        decode row of the same token, and a prompt's rows the same whatever chunk they come
        in. Products through our kernels are batch-invariant already; norms, rotary and the
        MLP's activation work row by row, and the attention backend for these dtypes is the
        invariant one. Steps of more rows than that cost more (the weights are read once a
        call, docs/cpu.md)."""
        self.lm_head_t = None  # (the LM head through its Linear, unless through our kernel)
        dense = [m for m in self.modules() if isinstance(m, Linear) and m.packed is None and m.weight.numel()
                 and not (m is self.lm_head and self.lm_head_kernel is not None)]
        if not dense:
            return
        for module in dense:  # (a one-row GEMV sums otherwise than the many-row GEMM)
            module.pad_single_row = True
        rows = invariant_call_rows(dense)
        for module in dense:
            module.rows_per_call = rows
        self.invariant_rows = rows

    def finalize_weights(self, c_kernels: bool = True) -> None:
        """Call once the weights are final (loaded and cast). c_kernels False: none of our C
        kernels below, PyTorch ops only (the compiled step on a CPU, model/compiled.py).

        CPU float32 where our linear kernel builds: every projection and the LM head through it
        (the layers' weights move into its layout, in GGUF's Q4_1/Q8_0 blocks where they are
        exactly such blocks; the LM head's weight stays, draft heads read it). It gives a row the
        same bits whatever the batch, which speculation needs to be lossless; PyTorch's float32
        GEMM does not (MKL and oneDNN pick their blocking and their split of the sums by the
        number of rows: on an AMX Xeon 2 and 3 rows gave other bits than 64 rows for every
        product of the default model's shapes, up to 56 rows for some, docs/cpu.md), so it is
        never the target's, even where it is faster (an AMX Xeon at 32-64 rows of a non-GGUF
        model). Else CPU float32 (no kernel on this CPU): MKL reads an [H, V]
        weight for a skinny product about twice as fast as the [V, H] nn.Linear layout
        (measured on the default model's 49k x 576 head, one row), so the head keeps a
        transposed copy. CPU bfloat16: oneDNN is faster with the nn.Linear layout, and one-row
        products go through the many-row GEMM (see `Linear`) so that a one-token step computes
        what a small verification batch does (beyond that oneDNN's bfloat16 GEMM is not
        batch-invariant on every CPU, docs/cpu.md). CUDA: none of these. CPU float32 where our
        kernels build: the RMS norms with their residual adds, the rotary embedding and the MLP
        activation in one C call each (specserve.kernels.cpu.layer_ops; a few rows paid ~20 dispatches per layer).
        """
        from specserve.kernels.cpu import cpu_linear
        from specserve.model.quant import pick_wide_blocks

        weight = self.lm_head.weight.detach()
        cpu = weight.device.type == "cpu"
        f32 = cpu and weight.dtype == torch.float32
        if c_kernels and f32 and self.lm_head_kernel is None and cpu_linear.available():
            layers = self._pack_products(cpu_linear.pack_float32)
            if self.lm_head_kernel.format != "f32":  # GGUF blocks: AVX-512 or AVX2, as measured here
                pick_wide_blocks(layers)
            if self.lm_head_kernel.format == "q8_0" and cpu_linear.a8_available():
                self.argmax_head = cpu_linear.ArgmaxHead(self.lm_head_kernel, weight)
        self.lm_head_t = weight.t().contiguous() if f32 and self.lm_head_kernel is None else None
        for module in self.modules():
            if isinstance(module, Linear):
                module.pad_single_row = cpu and weight.dtype == torch.bfloat16
        self.use_layer_ops(c_kernels and f32 and layer_ops.available())

    def use_layer_ops(self, enabled: bool) -> None:
        """Every norm's `add`, every rotary embedding and every MLP activation through
        specserve.kernels.cpu.layer_ops (CPU float32; rotary only where no q/k norm comes between
        projection and rotation), or through PyTorch ops. Enabled, and where every layer is
        then our kernels alone, the layers run in one C call a step (`decoder`)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.fused = enabled
            elif isinstance(module, Attention):
                module.fused_rotary = enabled and module.q_norm is None
        self.decoder = self._c_decoder() if enabled else None

    def _c_decoder(self):
        """specserve.kernels.cpu.decoder.Decoder over every layer, or None where a layer is not
        our kernels alone: a product that is not a cpu_linear kernel (PyTorch's GEMM, a tensor
        parallel shard), q/k norms, a norm's own eps, an embedding that is not the plain table.
        The forward then runs it for steps of the CPU paged attention kernel (CPUPagedMetadata),
        with the same bits as the layer-by-layer path."""
        from specserve.kernels.cpu import decoder

        if type(self.embed_tokens) is not nn.Embedding or not decoder.available():
            return None
        eps, layers = self.norm.eps, []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            products = [packed_product(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (None in products or attn.q_norm is not None or type(layer) is not DecoderLayer
                    or any(type(n) is not RMSNorm or n.eps != eps for n in norms)):
                return None
            layers.append((*products, *(n.weight.data for n in norms)))
        a = self.arch
        return decoder.Decoder(layers, self.norm.weight.data, a.hidden_size, a.num_heads, a.num_kv_heads,
                               a.head_dim, a.intermediate_size, eps, a.head_dim ** -0.5)

    # -- weights --------------------------------------------------------------------------
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up projections."""
        own = self.state_dict()
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            if name not in own:
                raise ValueError(f"model: unexpected weight {name}")
            if own[name].shape != value.shape:
                raise ValueError(f"model: weight {name} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(own[name].shape)}")
            own[name].copy_(value)
            loaded.add(name)

        with torch.no_grad():
            for i in range(self.arch.num_layers):
                pre = f"model.layers.{i}."
                for kind in ("weight", "bias"):
                    parts = [state.pop(f"{pre}self_attn.{p}_proj.{kind}", None) for p in "qkv"]
                    if all(p is not None for p in parts):
                        put(f"layers.{i}.self_attn.qkv_proj.{kind}", torch.cat(parts))
                gate = state.pop(f"{pre}mlp.gate_proj.weight", None)
                up = state.pop(f"{pre}mlp.up_proj.weight", None)
                if gate is not None and up is not None:
                    put(f"layers.{i}.mlp.gate_up_proj.weight", torch.cat([gate, up]))
            for name, value in state.items():
                if "rotary_emb" in name:
                    continue
                key = name.removeprefix("model.")
                if key == "lm_head.weight" and self.arch.tie_word_embeddings:
                    continue
                put(key, value)
        missing = [n for n in own if n not in loaded and not (
            n == "lm_head.weight" and self.arch.tie_word_embeddings)]
        if missing:
            raise ValueError(f"model: checkpoint lacks weights {missing[:4]}{'...' if len(missing) > 4 else ''}")
