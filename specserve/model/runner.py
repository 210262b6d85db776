"""ModelRunner: owns the model, its paged KV cache tensors and the per-step input tensors.

`execute` turns a SchedulerOutput into one flattened forward pass and returns, for every
scheduled request that caught up with its known tokens, the logits rows the step must sample
or verify: one row for a plain decode or finished prefill, 1 + k rows for k drafts (row j is
the target's distribution after draft j-1). Requests still in the middle of a chunked prefill
get no rows. Sampling and verification happen in the engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config import QUANTIZATION_NOTE, CacheConfig, ModelConfig
from specserve.host import int_tensor
from specserve.kernels.cpu import layer_ops
from specserve.model.arch import ModelArch
from specserve.model import tree_mask
from specserve.model.attention import get_attention_backend
from specserve.model.llama import LlamaForCausalLM
from specserve.model.loader import load_safetensors
from specserve.model.parallel import TensorParallel, local_heads
from specserve.scheduler.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def batch_invariant_on(choice: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a target computes every row with the bits it gets alone (`--batch-invariant`).
    On CUDA its products, norms and elementwise steps go through the batch-invariant Triton ops
    (model/invariant_ops.py); on a CPU the products that go through PyTorch's GEMM are cut into
    calls of a size that keeps each row's bits (LlamaForCausalLM.use_invariant_call_rows; a CPU's
    float32 C kernels are batch-invariant by construction). None (the default) turns it on for
    bfloat16 and float16, where cuBLAS's and oneDNN's products chosen by row count made greedy
    speculation give other tokens than plain decoding (on an H200 the 8B-shaped step costs 0.91x
    with them at one request, docs/benchmarks.md); float32 keeps PyTorch's products unless asked."""
    if device.type not in ("cuda", "cpu"):
        return False
    return dtype in (torch.bfloat16, torch.float16) if choice is None else bool(choice)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": on CUDA bfloat16 (float16 where it is not supported). On a CPU float32 where our
    C kernels run (x86 with AVX2: products, norms, rotary and attention in C, and a GGUF
    model's weights read in their Q4_1/Q8_0 blocks; on an AVX512-BF16 AMD EPYC, 3.2x
    oneDNN's bfloat16 at one request and 1.7x at 8; on an AMX Xeon 3.5x at one request, 1.1x
    at 32, but bfloat16 1.14x faster at 64 in flight, docs/benchmarks.md: the dtype is chosen
    once, for low load), else bfloat16 where the CPU multiplies it natively (AVX512-BF16 or
    AMX), else float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    from specserve.kernels.cpu import cpu_linear

    return torch.bfloat16 if cpu_has_native_bf16() and not cpu_linear.available() else torch.float32


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def kv_bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """K and V of every layer for one block of tokens (on one rank of `tp_size`: its KV heads)."""
    kv_heads = local_heads(arch.num_heads, arch.num_kv_heads, tp_size)[1]
    return 2 * arch.num_layers * block_size * kv_heads * arch.head_dim * dtype.itemsize


@dataclass
class StepLogits:
    logits: torch.Tensor  # [R, V] float32 rows to sample or verify
    hidden: torch.Tensor  # [R, hidden] final hidden states of those rows (for draft heads)
    row_start: list[int]  # per scheduled request: first row, or -1 when it has none
    num_rows: list[int]  # per scheduled request: 0, 1 or 1 + num_drafts
    all_hidden: torch.Tensor  # [T, hidden] final hidden states of every token of the step
    # [T, model.output_width]: all_hidden followed by the outputs of the model's aux_layers for
    # every token (what an EAGLE head reads; the forward's own output, all_hidden a view of it);
    # all_hidden itself when there are no aux layers
    features: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.features is None:
            self.features = self.all_hidden


class ModelRunner:
    def __init__(self, model_dir: Path | None, arch: ModelArch, model_config: ModelConfig,
                 cache_config: CacheConfig, max_model_len: int, tp: TensorParallel | None = None) -> None:
        """`tp`: this rank's place in a tensor-parallel group (model/parallel.py,
        model/tp_worker.py): the model keeps its slice, the KV cache its KV heads."""
        self.arch = arch
        self.tp = tp
        self.device = pick_device(model_config.device) if tp is None else tp.device
        self.dtype = pick_dtype(model_config.dtype, self.device)
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        start = time.time()
        with torch.device(self.device):
            model = LlamaForCausalLM(arch, max_positions=max_model_len + 64)
        if model_config.load_format == "dummy" or model_dir is None:
            _init_dummy(model, model_config.seed)
        else:
            model.load_hf_state_dict(load_safetensors(model_dir))
        if tp is not None:
            tp.shard(model)
        self.model = model.to(self.dtype).eval()
        self.model.rotary.float()
        self.quantization = model_config.quantization
        if self.quantization == "int8":
            self.model.quantize_int8()
        elif self.quantization == "gguf":
            self.model.use_gguf_products()
        from specserve.model.compiled import step_mode

        # (compile, graphs) of the step (model/compiled.py); a compiled CPU step uses no C kernel
        invariant = self.batch_invariant = batch_invariant_on(model_config.batch_invariant, self.device, self.dtype)
        self.step_mode = step_mode(self.device, model_config.enforce_eager or tp is not None, self.quantization,
                                   eager_arithmetic=invariant and arch.qk_norm)
        self.model.finalize_weights(c_kernels=not self.step_mode[0])
        if invariant and self.device.type == "cuda":
            self.model.use_invariant_products()
        elif invariant:  # (a CPU: PyTorch's products cut into calls that keep each row's bits)
            self.model.use_invariant_call_rows()
        self.steps, self.graph_capture_seconds = None, 0.0  # set by prepare_steps
        self.tp_size = 1 if tp is None else tp.size
        heads, kv_heads = local_heads(arch.num_heads, arch.num_kv_heads, self.tp_size)
        self.backend = get_attention_backend(self.device, self.dtype, (heads, kv_heads, arch.head_dim))
        # callables (sched, features [T, model.output_width]) shown every step's final hidden
        # states (and aux layers' outputs), before anything else reads them (training data
        # capture: spec_decode.training.data)
        self.hidden_hooks: list = []
        self.num_blocks = cache_config.num_blocks or self._blocks_for(cache_config.kv_cache_memory_gb)
        # one tensor per K and V for all layers ([L, num_blocks, block_size, Hkv, D]); each
        # layer reads its own view, KV moves (move_kv) touch every layer in one call. One block
        # more than the pool's: the null block, no request's, where padding rows write (step_buffers.py)
        self.null_block = self.num_blocks
        shape = (arch.num_layers, self.num_blocks + 1, self.block_size, kv_heads, arch.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = list(zip(self.k_cache.unbind(0), self.v_cache.unbind(0)))
        self._move_slots = (layer_ops.slot_mover(self.k_cache, self.v_cache)
                            if self.device.type == "cpu" and layer_ops.available() else None)
        logger.info("model ready in %.1f s on %s (%s%s, %s attention); KV cache: %d blocks of %d "
                    "tokens", time.time() - start, self.device, str(self.dtype).split(".")[-1],
                    QUANTIZATION_NOTE.get(self.quantization, ""),
                    type(self.backend).__name__, self.num_blocks, self.block_size)

    def prepare_steps(self, max_num_seqs: int, max_num_batched_tokens: int, max_width: int) -> None:
        """Set up the compiled / graph-captured step (model/compiled.py) where step_mode says
        so, for batches of up to max_num_seqs requests whose longest query is max_width tokens
        (1: decodes only); CUDA graphs are captured here (graph_capture_seconds). Not under
        tensor parallelism: step_mode keeps its ranks on the eager path."""
        compile, graphs = self.step_mode
        if compile or graphs:
            from specserve.model.compiled import StepRunner

            self.steps = StepRunner(self, max_num_seqs, max_num_batched_tokens, max_width, compile, graphs)
            self.graph_capture_seconds = self.steps.capture()

    def _blocks_for(self, gigabytes: float) -> int:
        return max(16, int(gigabytes * (1 << 30)) // kv_bytes_per_block(self.arch, self.block_size, self.dtype,
                                                                          self.tp_size))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                tree_parents: list[list[int] | None] | None = None) -> StepLogits:
        ids: list[int] = []
        positions: list[int] = []
        seq_lens, row_start, num_rows, row_index, argmax_only = [], [], [], [], []
        argmax_head = self.model.argmax_head is not None and self.tp is None  # (else: every row's full head)
        for req, n, k in zip(sched.requests, sched.num_tokens, sched.num_drafts):
            start, committed = req.num_computed_tokens, req.num_tokens
            ids += req.all_token_ids[start:min(start + n, committed)]  # slices, not a copy of all
            if start + n > committed:
                ids += req.spec_token_ids[:start + n - committed]
            positions += range(start, start + n)
            seq_lens.append(start + n)
            if start + n == committed + k:  # caught up: sample (or verify k drafts + bonus)
                row_start.append(len(row_index))
                num_rows.append(k + 1)
                row_index += range(len(ids) - k - 1, len(ids))
                if argmax_head:
                    argmax_only += [argmax_is_all(req.params)] * (k + 1)
            else:
                row_start.append(-1)
                num_rows.append(0)
        if tree_parents is not None:  # tree nodes sit at prefix + depth, not prefix + index
            positions = tree_mask.tree_positions(positions, sched.num_tokens, tree_parents)
        step = (ids, positions, seq_lens, list(sched.num_tokens), [r.block_ids for r in sched.requests],
                tree_parents, row_index, argmax_only or None)
        # tensor parallel: every worker runs the same forward on these inputs (model/tp_worker.py)
        every, hidden, logits = self.forward(*step) if self.tp is None else self.tp.run("forward", self.forward, step)
        for hook in self.hidden_hooks:
            hook(sched, every)
        return StepLogits(logits, hidden, row_start, num_rows, every[:, :self.arch.hidden_size], every)

    def set_aux_layers(self, layers: tuple[int, ...]) -> None:
        """Have every step also return the outputs of these decoder layers (StepLogits.features);
        before prepare_steps (the compiled step and its graphs are built with them). Under tensor
        parallelism rank 0's model alone: every rank holds the whole residual stream."""
        if self.steps is not None:
            raise RuntimeError("set_aux_layers after the compiled step was built")
        if any(not 0 <= i < self.arch.num_layers for i in layers) or list(layers) != sorted(set(layers)):
            raise ValueError(f"aux layers {layers}: increasing indices of the model's "
                             f"{self.arch.num_layers} layers")
        self.model.aux_layers = tuple(layers)

    @torch.inference_mode()
    def forward(self, ids: list[int], positions: list[int], seq_lens: list[int], query_lens: list[int],
                block_tables: list[list[int]], tree_parents, row_index: list[int],
                argmax_only: list[bool] | None = None):
        """The model's part of a step -> (final hidden states of every token [T, hidden], of the
        rows to sample [R, hidden], their logits [R, V] float32: None on a tensor-parallel
        worker, whose slice of the vocabulary goes to rank 0). argmax_only: per row to sample,
        whether its argmax is all anyone reads of its logits (`argmax_is_all`)."""
        every = None if self.steps is None else self.steps.forward(
            ids, positions, seq_lens, query_lens, block_tables, tree_parents)
        if every is None:  # the eager path
            meta = self.backend.build_metadata(seq_lens, query_lens, block_tables, self.block_size,
                                               self.device, tree_parents)
            ids_pos = int_tensor([ids, positions], self.device)
            every = self.model(ids_pos[0], ids_pos[1], self.kv_caches, meta, self.backend)
        final = every[:, :self.arch.hidden_size] if self.model.aux_layers else every
        hidden = (final.contiguous() if len(row_index) == len(ids)
                  else final.index_select(0, int_tensor(row_index, self.device)))
        logits = self.model.compute_logits(hidden, argmax_only)
        return every, hidden, logits if self.tp is None else self.tp.gather_vocab(logits)

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of cache slots src to slots dst in every layer (accepted draft paths
        moving next to their roots): one call for all layers (tensor parallel: on every rank)."""
        if self.tp is not None:
            self.tp.run("move_kv", self._move_kv, (src, dst))
        else:
            self._move_kv(src, dst)

    def _move_kv(self, src: list[int], dst: list[int]) -> None:
        if self._move_slots is not None:  # the CPU: one C call, no index tensors
            self._move_slots(src, dst)
            return
        from specserve.kernels import compact_kv

        slots = int_tensor([src, dst], self.device)
        compact_kv(self.k_cache, self.v_cache, slots[0], slots[1])


def argmax_is_all(params) -> bool:
    """Whether a request's sampling reads nothing of a row's logits but its argmax: greedy,
    no penalties, no grammar, logit_bias or min_tokens, no logprobs (the model's LM head may
    then compute the rest of the row approximately: LlamaForCausalLM.argmax_head)."""
    return params.greedy and not params.has_penalties and not params.constrained and params.logprobs is None


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights in the config's shape (for speed benchmarks and unit tests)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02 if p.device.type == "cpu"
                        else (torch.randn(p.shape, generator=gen) * 0.02).to(p.device))
