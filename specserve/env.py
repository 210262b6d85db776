"""The package's SPECSERVE_ environment variables (`env_str`) and the cache directory one of them
names (`cache_root`). It imports nothing of the package, so every layer can use it, the build of
the C kernels included.
"""

from __future__ import annotations

import os
from pathlib import Path


def env_str(name: str, default: str = "") -> str:
    """The one place the package reads environment variables (all prefixed SPECSERVE_)."""
    return os.environ.get(f"SPECSERVE_{name}", default)


def cache_root() -> Path:
    """Where converted models and compiled kernels are kept: $SPECSERVE_CACHE_DIR, by default
    ~/.cache/specserve."""
    return Path(env_str("CACHE_DIR") or Path.home() / ".cache" / "specserve")
