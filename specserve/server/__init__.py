"""The OpenAI-compatible HTTP server: FastAPI app, protocol models, the async engine bridge.

Entry points: `specserve serve` / `python -m specserve.server` (cli.run_server), or
`build_app(AsyncEngine(engine), name)` to embed the app elsewhere.
"""

from specserve.server.async_engine import AsyncEngine
from specserve.server.cli import add_serve_args, run_server

__all__ = ["AsyncEngine", "add_serve_args", "run_server", "build_app"]


def __getattr__(name: str):
    if name == "build_app":  # FastAPI is imported lazily: the CLI's --help stays fast
        from specserve.server.app import build_app
        return build_app
    raise AttributeError(name)
