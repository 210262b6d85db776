"""The default model's ModelRunner and a KV cache manager for the step-level benchmarks."""


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
