"""Weight-only int8 linear layers on x86 CPUs: our own AVX2/FMA kernel (`int8_linear.c`).

torch's int8 weight-only CPU kernel is slower than float32 GEMMs on AVX2-only machines and
its sums depend on how many rows a product has; this one reads a quarter of float32's weight
bytes and gives each row the same bits whatever the rest of the batch (see the C source), so
speculation over an int8 target stays token-for-token identical to plain decoding.

The source is compiled once with the system's C compiler (gcc or cc, `-O3 -mavx2 -mfma
-fopenmp`) into `$SPECSERVE_CACHE_DIR/kernels/`, keyed by the source's hash, and called through
ctypes, which releases the GIL. It shares torch's OpenMP runtime (same soname), and uses
torch's thread count. `available()` says whether it can run here, and `why_unavailable()` why
not: no AVX2/FMA, no compiler, or the build failed.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_linear.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]

_lib: ctypes.CDLL | None = None
_error: str | None = None
BLOCK = 64  # columns per block the threads split (BLOCK in int8_linear.c); strips of 8 inside


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build() -> Path:
    from specserve.model.loader import cache_root

    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags():
        raise RuntimeError("this CPU lacks AVX2/FMA")
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"int8_linear-{digest}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(built, out)  # atomic: concurrent builders each publish a whole file
    logger.info("compiled the int8 linear kernel into %s", out)
    return out


def _load() -> ctypes.CDLL | None:
    global _lib, _error
    if _lib is None and _error is None:
        try:
            lib = ctypes.CDLL(str(_build()))
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            lib.int8_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, ctypes.c_int]
            lib.int8_linear.restype = None
            _lib = lib
        except (OSError, RuntimeError) as e:
            _error = str(e)
            logger.info("int8 linear kernel unavailable: %s", _error)
    return _lib


def available() -> bool:
    return _load() is not None


def why_unavailable() -> str | None:
    _load()
    return _error


class PackedInt8:
    """A layer's int8 weights in the kernel's layout, with their scales and bias (float32),
    callable on activations: x [..., K] -> [..., N] float32 = x @ (q * scales[:, None]).T + bias.
    The pointers are taken once here: a decode step calls a hundred-odd of these."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        lib = _load()
        assert lib is not None, _error
        q = q.detach().to(device="cpu", dtype=torch.int8)
        self.out_features, self.in_features = n, k = q.shape
        padded = torch.zeros(-(-n // BLOCK) * BLOCK, k, dtype=torch.int8)  # zero columns never written
        padded[:n] = q
        # [N, K] -> strips of 8 columns, k-major inside a strip: [N / 8, K, 8]
        self.packed = padded.view(-1, 8, k).transpose(1, 2).contiguous()
        self.scales = scales.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._fn = lib.int8_linear
        self._weights = self.packed.data_ptr()
        self._scales = self.scales.data_ptr()
        self._bias = 0 if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # the kernel trusts its sizes
            raise ValueError(f"int8 linear: input has {x.shape[-1]} features, expected {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        m, n = rows.shape[0], self.out_features
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            self._fn(rows.data_ptr(), m, self.in_features, rows.stride(0), self._weights, n,
                     self._scales, self._bias, y.data_ptr(), n, torch.get_num_threads())
        return y.view(*x.shape[:-1], n)
