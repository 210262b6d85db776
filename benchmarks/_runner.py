"""The default model's ModelRunner and a KV cache manager for the step-level benchmarks, a
timer to wrap the calls they split a step into, and the side-by-side level of the A/B
experiments over bench load's closed loop (`ab_level`)."""

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


def levels(specs: list[str]) -> list[tuple[int, int]]:
    """--levels CONCURRENCY:REQUESTS ... as (concurrency, requests) pairs."""
    return [tuple(map(int, spec.split(":"))) for spec in specs]


def ab_level(engines: dict, ids: list[list[int]], concurrency: int, requests: int, params, base: str,
             reference: str | None = None) -> dict:
    """One level of bench load's closed loop with every engine's steps interleaved: prints each
    engine's tok/s and its ratio over `base`'s, and how many outputs differ from `reference`'s
    (default: base's). -> {engine name: Run}."""
    from specserve.bench.load import ClosedLoop, interleaved, request_list

    names = list(engines)
    loops = [ClosedLoop(engines[m].engine, request_list(ids, concurrency, requests), concurrency, params,
                        f"{m}-c{concurrency}") for m in names]
    runs = dict(zip(names, interleaved(loops)))
    rate, ref = runs[base].tokens_per_s, runs[reference or base].outputs
    print(f"c={concurrency}: " + "  ".join(f"{m} {r.tokens_per_s:.1f} tok/s ({r.tokens_per_s / rate:.3f})"
                                         for m, r in runs.items()))
    print(f"   mismatches against {reference or base}:",
          {m: sum(a != b for a, b in zip(r.outputs, ref)) for m, r in runs.items()}, flush=True)
    return runs
