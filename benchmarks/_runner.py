"""The default model's ModelRunner and a KV cache manager for the step-level benchmarks, and a
timer to wrap the calls they split a step into."""

import time


def default_runner(num_blocks: int, max_model_len: int = 4096):
    from specserve.config import DEFAULT_MODEL, CacheConfig, ModelConfig
    from specserve.kv_cache.manager import KVCacheManager
    from specserve.model.arch import ModelArch
    from specserve.model.loader import resolve_model_dir
    from specserve.model.runner import ModelRunner

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    runner = ModelRunner(model_dir, ModelArch.from_dir(model_dir), ModelConfig(), CacheConfig(num_blocks=num_blocks),
                         max_model_len)
    return runner, KVCacheManager(num_blocks, 16, enable_prefix_caching=False)


def prompt_features(runner, kv, req):
    """The target features an EAGLE head reads over a request's whole prompt: its final hidden
    states ([n, hidden]), then the aux layers' outputs where the model returns them; its KV
    computed (one forward; the caller frees the request's blocks)."""
    from specserve.scheduler.scheduler import SchedulerOutput

    kv.allocate(req, req.num_tokens)
    step = runner.execute(SchedulerOutput([req], [req.num_tokens], [0]))
    req.num_computed_tokens = req.num_tokens
    return step.features


def timed(totals: dict, key: str, fn):
    """fn, adding the seconds of each call to totals[key]."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
        return out
    return wrapper
