"""Weight-only int8 linear layers for CPUs: the target's (`--quantization int8`) and draft heads'.

`Int8Linear` keeps a linear layer's weights as symmetric int8 with one scale per output row.
Where our AVX2/FMA kernel builds (specserve.kernels.cpu.cpu_linear: x86 with AVX2, a C compiler),
every product goes through it: a quarter of float32's weight bytes, and each row's result
independent of the other rows, so a quantized target keeps speculation exactly lossless
against plain decoding of the same quantized model. Elsewhere draft heads fall back to torch's
int8 weight-only kernel (`torch._weight_int8pack_mm`) for products of up to `MAX_ROWS` rows and
a dequantized copy beyond; that path is not batch-invariant, so the target refuses it.
Whether int8 is faster than the dtype's own GEMM for a draft head depends on the CPU, so
`int8_rows` measures it where it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.cpu import cpu_linear


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: weight [N, K] -> (int8 [N, K], scales [N] in weight's dtype)."""
    w = weight.detach().float()
    scales = w.abs().amax(1).clamp(min=1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(weight.dtype)


class Int8Linear(nn.Module):
    """y = x @ dequant(W).T + b with W in int8 (see the module docstring)."""

    MAX_ROWS = 4  # torch's kernel (no own kernel): up to this many rows; more: dequantized weights

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        q, scales = quantize_rows(weight)
        self.out_features = weight.shape[0]
        self.own_kernel = weight.device.type == "cpu" and cpu_linear.available()
        if self.own_kernel:
            self.kernel = cpu_linear.PackedInt8(q, scales, bias)  # holds the weights (not buffers:
            # the kernel keeps pointers to them, so they must never move or be cast)
        else:
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales)
            self.register_buffer("weight", (q.float() * scales.float()[:, None]).to(weight.dtype))
            self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_kernel:
            return self.kernel(x).to(x.dtype)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = torch._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(linear.weight, linear.bias)


def quantize_linears(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear inside module (in place) with an Int8Linear; returns module."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear.from_linear(child))
        else:
            quantize_linears(child)
    return module


def check_target_quantization(value: str, device: str, dtype: str = "auto") -> None:
    """Check that the target can take `--quantization value` on `device` in `dtype` here
    (ValueError with the reason); value is one of specserve.config.QUANTIZATION_CHOICES,
    which EngineConfig.create checked before asking."""
    if value == "none":
        return
    if device not in ("auto", "cpu") or (device == "auto" and torch.cuda.is_available()):
        raise ValueError(f"quantization: {value!r} runs on the CPU only")
    if value == "int8" and not cpu_linear.available():
        raise ValueError(f"quantization: 'int8' needs the int8 CPU kernel, which cannot run here "
                         f"({cpu_linear.why_unavailable()})")
    if value == "gguf":
        if not cpu_linear.available() or not cpu_linear.a8_available():
            why = cpu_linear.why_unavailable() or cpu_linear.a8_why_unavailable()
            raise ValueError(f"quantization: 'gguf' needs its CPU kernel, which cannot run here ({why})")
        if dtype not in ("auto", "float32"):
            raise ValueError(f"quantization: 'gguf' computes in float32 between its products; "
                             f"drop --dtype {dtype} (or pass float32)")


_INT8_ROWS: dict[tuple, int] = {}
_F32_PAYS: dict[tuple, bool] = {}
_A8_PAYS: dict[tuple, bool] = {}
_WIDE: list[bool] = []  # pick_wide_blocks' answer, once measured
_VNNI: list[bool] = []  # pick_a8_vnni's


def _faster(ours, theirs, hidden: int, dtype: torch.dtype, rows_list=(1, 4), margin: float = 0.9,
            rounds: int = 20) -> bool:
    """Whether `ours` takes under margin x the time of `theirs` at every row count (best of 3
    rounds of `rounds` calls each, side by side)."""
    import time

    for rows in rows_list:
        x = torch.randn(rows, hidden, dtype=dtype)
        best = {}
        for _ in range(3):
            for name, fn in (("ours", ours), ("theirs", theirs)):
                fn(x)
                start = time.perf_counter()
                for _ in range(rounds):
                    fn(x)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
        if best["ours"] > margin * best["theirs"]:
            return False
    return True


def _streamed(hidden: int, intermediate: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """[intermediate, hidden] matrices of 48 MB in all: more than a CPU's caches hold, so that
    products over them in turn read their weights from memory, as a draft's do in a decode step
    (the target's step before them streams its own weights through the caches)."""
    count = min(256, max(2, (48 << 20) // (dtype.itemsize * hidden * intermediate)))
    return [torch.randn(intermediate, hidden, dtype=dtype) * 0.02 for _ in range(count)]


def _in_turn(products: list) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """One call that runs every product on x in turn (a measurement's unit)."""
    return lambda x: [p(x) for p in products]


def f32_kernel_pays(hidden: int, intermediate: int) -> bool:
    """Whether our float32 linear kernel (specserve.kernels.cpu.cpu_linear) beats torch's GEMM on
    this CPU at 1 and 8 rows (by 10%), over streamed weights (`_streamed`, read transposed, as a
    draft's products take them: spec_decode.quant.draft_linear). The choice for a float32 draft
    head's products (a target's always take our kernel: batch invariance,
    LlamaForCausalLM.finalize_weights). Cached."""
    key = (hidden, intermediate, torch.get_num_threads())
    if key not in _F32_PAYS:
        _F32_PAYS[key] = False
        if cpu_linear.available():
            weights = _streamed(hidden, intermediate, torch.float32)
            packed = [cpu_linear.PackedFloat32(w, None) for w in weights]
            transposed = [w.t().contiguous() for w in weights]
            _F32_PAYS[key] = _faster(_in_turn(packed), _in_turn([lambda x, w=w: x @ w for w in transposed]),
                                     hidden, torch.float32, (1, 8), rounds=5)
    return _F32_PAYS[key]


def a8_pays(hidden: int, intermediate: int, current: Callable[[torch.Tensor], Callable]) -> bool:
    """Whether a float32 draft head's products are faster with int8 activations against Q8_0
    blocks (cpu_linear.pack_a8, as `--quantization gguf` multiplies) than as they would
    otherwise run (current(weight) -> the product: int8 weights or our float32 kernel), by 10%
    at 1, 4 and 16 rows (a pass of one request, a tree's frontier, several requests' nodes)
    over streamed weights. Only drafts change: verification is the target's. Cached."""
    key = (hidden, intermediate, torch.get_num_threads())
    if key not in _A8_PAYS:
        _A8_PAYS[key] = False
        if cpu_linear.a8_available() and hidden % cpu_linear.QK == 0:
            weights = _streamed(hidden, intermediate, torch.float32)
            ours = _in_turn([cpu_linear.pack_a8(w, None) for w in weights])
            _A8_PAYS[key] = _faster(ours, _in_turn([current(w) for w in weights]), hidden, torch.float32,
                                    (1, 4, 16), rounds=5)
    return _A8_PAYS[key]


def pick_wide_blocks(layers: list) -> bool:
    """Whether our kernel runs GGUF blocks with AVX-512 (specserve.kernels.cpu.cpu_linear.wide) or
    AVX2, from which of the two is faster at 1 and 8 rows over `layers` (packed products that
    take [rows, hidden], e.g. a model's every q/k/v and gate/up: tens of MB, as a decode step
    streams them). Both give the same bits, so this is a choice of speed alone, measured where
    it runs (on an AMX Xeon AVX-512 was 1.1x at one row and 1.7x at 8; CPUs that split 512-bit
    operations may differ). Sets the kernel's choice and returns it; asked once a process."""
    if not cpu_linear.available() or not cpu_linear.wide():  # no AVX-512F, or kept to AVX2 (emulated AVX2)
        return False
    if not _WIDE:
        _WIDE.append(_isa_faster(layers, cpu_linear.wide))
    return cpu_linear.wide(_WIDE[0])


def pick_a8_vnni(layers: list) -> bool:
    """Whether `--quantization gguf`'s products run with AVX512-VNNI or AVX2
    (specserve.kernels.cpu.cpu_linear.a8_vnni), from which is faster at 4 and 8 rows over
    `layers` (packed products, as for pick_wide_blocks: the same bits either way). Verify
    steps have such rows; at one or two rows both read the weights at about memory speed, and
    which wins there is within a VM's noise (on a Zen 4, 2026-12-01: one row 5.3-6.0 ms either
    way for the default model, eight rows 8.9 ms with VNNI against 15.8 with AVX2). Sets the
    kernel's choice and returns it; asked once a process."""
    if not cpu_linear.a8_available() or not cpu_linear.a8_vnni():  # no AVX512-VNNI, or kept to AVX2
        return False
    if not _VNNI:
        _VNNI.append(_isa_faster(layers, cpu_linear.a8_vnni, (4, 8)))
    return cpu_linear.a8_vnni(_VNNI[0])


def _isa_faster(layers: list, use, rows=(1, 8)) -> bool:
    """Whether `layers`' products (each taking [rows, hidden]) run at least as fast with
    use(True) as with use(False) at each of `rows`, side by side."""
    def run(on: bool):
        def products(x):
            use(on)
            for layer in layers:
                layer(x)
        return products

    return _faster(run(True), run(False), layers[0].in_features, torch.float32, rows, margin=1.0, rounds=3)


INT8_ROWS = (8, 16, 32, 64)  # row counts int8_rows tries past the first 4


def int8_rows(hidden: int, intermediate: int, dtype: torch.dtype, float_linear=None) -> int:
    """Up to how many rows int8 weight-only products beat the dtype's on this CPU, over
    streamed head-sized weights (`_streamed`: in a decode step a draft's weights come from
    memory, where int8's quarter of the bytes counts; one matrix held in the caches measured
    int8 1.1x at 4 rows on an AMX Xeon, streamed 1.7x). 0 unless int8 is 10% faster at 1 and
    4 rows; else 4 or the largest of INT8_ROWS, in order, at which it is no slower (past a
    few dozen rows rebuilding the weights costs more than their bytes save: streamed, 1.3x at
    8 rows, 0.9x at 24, 0.75x at 64 there). float_linear(weight) -> the product as the draft
    would otherwise run it (default: F.linear). Cached."""
    key = (hidden, intermediate, dtype, torch.get_num_threads())
    if key not in _INT8_ROWS:
        weights = _streamed(hidden, intermediate, dtype)
        ours = _in_turn([Int8Linear(w, None) for w in weights])
        theirs = _in_turn([(float_linear or (lambda w: lambda x: F.linear(x, w)))(w) for w in weights])
        rows = 0
        if _faster(ours, theirs, hidden, dtype, rounds=5):
            rows = 4
            for more in INT8_ROWS:
                if not _faster(ours, theirs, hidden, dtype, (more,), margin=1.0, rounds=2):
                    break
                rows = more
        _INT8_ROWS[key] = rows
    return _INT8_ROWS[key]
