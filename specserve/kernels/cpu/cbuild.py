"""Our C kernels for x86 CPUs (AVX2/FMA): compiled once, loaded through ctypes or imported
as CPython extension modules.

A source is compiled with the system's C compiler (gcc or cc, `-O3 -mavx2 -mfma -fopenmp`)
into `$SPECSERVE_CACHE_DIR/kernels/`, keyed by the hash of the source, of the C sources and
headers beside it and in the folders it includes from, and of the flags, and called through
ctypes, which releases the GIL. The libraries share torch's OpenMP runtime (same soname) and use
torch's thread count. `Kernel(source, declare).lib` is the loaded library or None, and
`why_unavailable()` says why: no AVX2/FMA, no compiler, or the build failed.
`Extension(source, include).module` builds a source as an extension module with Python's
headers and imports it (its functions release the GIL themselves): what a step calls between its
forwards takes and returns Python lists that way, where ctypes would spend more on converting
them than the kernel on its work. A source outside this folder that builds on these kernels (the
speculative methods' tree growth, specserve/spec_decode/tree_ops.c) names it, `CPU_DIR`, in
`include`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable

from specserve.env import cache_root

CPU_DIR = Path(__file__).parent  # the CPU's C kernels and headers
logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build(source_path: Path, extra_flags: tuple[str, ...] = (), include: tuple[Path, ...] = ()) -> Path:
    """The compiled library of a C source (cached by content: the source, the headers and C
    sources beside it and in the folders of `include`, which `#include "..."` searches, the
    flags); RuntimeError when it cannot be."""
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= cpu_flags():
        raise RuntimeError("this CPU lacks AVX2/FMA")
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    source = source_path.read_bytes()
    flags = [*FLAGS, *extra_flags, *(f"-I{d}" for d in include)]
    included = sorted({p for d in (source_path.parent, *include) for p in d.glob("*.[ch]")} - {source_path})
    digest = hashlib.sha256(source + b"".join(h.read_bytes() for h in included)
                            + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"{source_path.stem}-{digest}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        proc = subprocess.run([compiler, *flags, str(source_path), "-o", str(built)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(built, out)  # atomic: concurrent builders each publish a whole file
    logger.info("compiled %s into %s", source_path.name, out)
    return out


class _Built:
    """A C source built and loaded on first use by `load()`, once: the loaded object, or None
    and the reason, kept."""

    def __init__(self, source: Path, load: Callable[[], object]) -> None:
        self.source, self._load = source, load
        self._loaded = None
        self._error: str | None = None

    def _get(self):
        if self._loaded is None and self._error is None:
            try:
                self._loaded = self._load()
            except (ImportError, OSError, RuntimeError) as e:
                self._error = str(e)
                logger.info("%s unavailable: %s", self.source.name, self._error)
        return self._loaded

    def available(self) -> bool:
        return self._get() is not None

    def why_unavailable(self) -> str | None:
        self._get()
        return self._error


class Kernel(_Built):
    """A C source built and loaded through ctypes on first use; `declare(lib)` sets its
    functions' types; `lib` is the library or None."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None]) -> None:
        super().__init__(source, self._open)
        self.declare = declare

    @property
    def lib(self) -> ctypes.CDLL | None:
        return self._get()

    def _open(self) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(build(self.source)))
        self.declare(lib)
        return lib


class Extension(_Built):
    """A C source built as a CPython extension module (Python's headers needed) and imported on
    first use; `module` is the module or None."""

    def __init__(self, source: Path, include: tuple[Path, ...] = ()) -> None:
        super().__init__(source, self._import)
        self.include = include

    @property
    def module(self):
        return self._get()

    def _import(self):
        headers = sysconfig.get_paths()["include"]
        if not (Path(headers) / "Python.h").is_file():
            raise RuntimeError(f"no Python.h in {headers} (Python's development headers)")
        path = build(self.source, (f"-I{headers}",), self.include)
        name = self.source.stem
        spec = importlib.util.spec_from_file_location(name, path,
                                                      loader=importlib.machinery.ExtensionFileLoader(name, str(path)))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
