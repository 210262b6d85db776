"""Weight-only int8 linear layers for CPUs: the target's (`--quantization int8`) and draft heads'.

`Int8Linear` keeps a linear layer's weights as symmetric int8 with one scale per output row.
Where our AVX2/FMA kernel builds (specserve.kernels.cpu.cpu_linear: x86 with AVX2, a C compiler),
every product goes through it: a quarter of float32's weight bytes, and each row's result
independent of the other rows, so a quantized target keeps speculation exactly lossless
against plain decoding of the same quantized model. Elsewhere draft heads fall back to torch's
int8 weight-only kernel (`torch._weight_int8pack_mm`) for products of up to `MAX_ROWS` rows and
a dequantized copy beyond; that path is not batch-invariant, so the target refuses it.
Whether int8 is faster than the dtype's own GEMM for a draft head depends on the CPU, so
`int8_pays` measures it where it runs.
"""

from __future__ import annotations

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


def check_target_quantization(value: str, device: str) -> None:
    """Check that the target's weights can take `--quantization value` on `device` here
    (ValueError with the reason); value is one of specserve.config.QUANTIZATION_CHOICES,
    which EngineConfig.create checked before asking."""
    if value == "none":
        return
    if device not in ("auto", "cpu") or (device == "auto" and torch.cuda.is_available()):
        raise ValueError("quantization: 'int8' runs on the CPU only")
    if not cpu_linear.available():
        raise ValueError(f"quantization: 'int8' needs the int8 CPU kernel, which cannot run here "
                         f"({cpu_linear.why_unavailable()})")


_INT8_PAYS: dict[tuple, bool] = {}
_F32_PAYS: dict[tuple, bool] = {}
_WIDE: list[bool] = []  # pick_wide_blocks' answer, once measured


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


def f32_kernel_pays(hidden: int, intermediate: int) -> bool:
    """Whether our float32 linear kernel (specserve.kernels.cpu.cpu_linear) beats torch's GEMM on
    this CPU at 1 and 8 rows (by 10%), over 48 MB of [intermediate, hidden] matrices (read
    transposed, as a draft's products take them: spec_decode.quant.draft_linear): more than a
    CPU's caches hold, so that weights stream from memory as in a decode step. The choice for
    a float32 draft head's products (a target's always take our kernel: batch invariance,
    LlamaForCausalLM.finalize_weights). Cached."""
    key = (hidden, intermediate, torch.get_num_threads())
    if key not in _F32_PAYS:
        _F32_PAYS[key] = False
        if cpu_linear.available():
            count = min(256, max(2, (48 << 20) // (4 * hidden * intermediate)))
            weights = [torch.randn(intermediate, hidden) * 0.02 for _ in range(count)]
            packed = [cpu_linear.PackedFloat32(w, None) for w in weights]
            transposed = [w.t().contiguous() for w in weights]
            _F32_PAYS[key] = _faster(lambda x: [p(x) for p in packed], lambda x: [x @ w for w in transposed],
                                     hidden, torch.float32, (1, 8), rounds=5)
    return _F32_PAYS[key]


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
        hidden = layers[0].in_features

        def run(on: bool):
            def products(x):
                cpu_linear.wide(on)
                for layer in layers:
                    layer(x)
            return products

        _WIDE.append(_faster(run(True), run(False), hidden, torch.float32, (1, 8), margin=1.0, rounds=3))
    return cpu_linear.wide(_WIDE[0])


def int8_pays(hidden: int, intermediate: int, dtype: torch.dtype) -> bool:
    """Whether int8 weight-only products beat the dtype's GEMM on this CPU for 1 and 4 rows of
    a head-sized matrix (by 10%). Cached."""
    key = (hidden, intermediate, dtype, torch.get_num_threads())
    if key not in _INT8_PAYS:
        weight = torch.randn(intermediate, hidden, dtype=dtype) * 0.02
        _INT8_PAYS[key] = _faster(Int8Linear(weight, None), lambda x: F.linear(x, weight), hidden, dtype)
    return _INT8_PAYS[key]
