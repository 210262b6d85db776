"""Frozen configuration records passed down from the entry points (LLM, CLI, server).

Nothing here touches the model or the device; `EngineConfig.create` only checks values
and fills in defaults. Environment variables are read in one place: `specserve.env.env_str`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"
logger = logging.getLogger("specserve")

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_CHOICES = ("none", "int8", "gguf")  # the target's products (specserve.model.quant)
# how start-up messages name each (after the dtype)
QUANTIZATION_NOTE = {"int8": " with int8 weights", "gguf": " with int8 activations against GGUF blocks"}


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: see model.runner.pick_dtype)
    load_format: str = "auto"  # auto | dummy
    max_model_len: int | None = None  # None: the model's own context length
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0  # seed for dummy weights and unseeded requests' sampling streams
    # none | int8 (weight-only) | gguf (int8 activations against GGUF blocks); CPU: specserve.model.quant
    quantization: str = "none"
    tensor_parallel_size: int = 1  # ranks the target is split across (specserve.model.parallel)
    enforce_eager: bool = False  # no compiled step, no CUDA graphs (specserve.model.compiled)
    # CUDA: the products, norms and a layer's elementwise steps through batch-invariant kernels
    # (model/invariant_ops.py), so that a verify row gets the bits of the same token's decode row
    # (exactly lossless speculation in bfloat16). None: on for bfloat16/float16 on CUDA
    # (model.runner.batch_invariant_on)
    batch_invariant: bool | None = None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024


# the most drafts per step when num_speculative_tokens is not given (the cost model verifies
# what pays of them): lookup chains of 8, draft-model chains of 4, EAGLE trees of 8 nodes
# (the shipped head's best size where rows are nearly free, docs/benchmarks.md), Medusa's
# whole tree
DEFAULT_DRAFTS = {"ngram": 8, "suffix": 16, "draft_model": 4, "eagle": 8, "medusa": 64}
SPEC_METHODS = tuple(DEFAULT_DRAFTS)  # ngram, suffix, draft_model, eagle, medusa
MAX_MATCH = 64  # suffix decoding compares each occurrence of a context's last token this far back
# keys of our own, beside vLLM's, and the methods they apply to: "adaptive" (bool, all),
# "fairness" (0 <= f < 1, all: how far behind plain decoding's pace a request may fall over
# its life so that others' drafts are verified; spec_decode/policy.py), "lookup_branch" (int
# >= 0), "min_draft_prob" (0 <= p < 1: a fixed cut instead of the cost model's), "medusa_tree";
# suffix decoding's "max_match" (the longest suffix looked up, prompt_lookup_min..MAX_MATCH),
# "corpus_tokens" (finished outputs kept per tenant, int >= 0) and "shared_corpus" (bool:
# every tenant drafts from every output); vLLM's "quantization" names the draft head's
# weights ("auto" | "gguf" | "int8" | "none")
SPEC_KEY_METHODS = {"lookup_branch": ("eagle", "medusa"), "min_draft_prob": ("eagle",),
                    "medusa_tree": ("medusa",), "quantization": ("eagle", "medusa"),
                    "lookup": ("eagle", "medusa"), "max_match": ("suffix", "eagle", "medusa"),
                    "corpus_tokens": ("suffix", "eagle", "medusa"),
                    "shared_corpus": ("suffix", "eagle", "medusa")}
SPEC_KEYS_ALL_METHODS = ("adaptive", "fairness")  # our keys every method reads


def _int_at_least(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_medusa_tree(paths) -> None:
    """A list of paths of top-k ranks, each path's prefix in the list too."""
    if not (isinstance(paths, (list, tuple)) and paths and all(
            isinstance(p, (list, tuple)) and p and all(_int_at_least(r, 0) for r in p) for p in paths)):
        raise ValueError("speculative_config.medusa_tree: expected a non-empty list of paths, each "
                         "a non-empty list of ranks (integers >= 0)")
    have = {tuple(p) for p in paths}
    for p in have:
        if len(p) > 1 and p[:-1] not in have:
            raise ValueError(f"speculative_config.medusa_tree: path {list(p)} lacks its prefix")


@dataclass(frozen=True)
class SpecConfig:
    """vLLM's --speculative-config keys. method None means no speculation; "auto" (the
    default of LLM and `specserve serve`) is resolved by the engine (spec_decode.methods)."""

    method: str | None = None  # auto | ngram | suffix | draft_model | eagle | medusa
    num_speculative_tokens: int | None = None  # None: the method's default (DEFAULT_DRAFTS)
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    depth: int | None = None
    topk: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """A concrete method's values are checked here, before anything loads."""
        if self.method in (None, "auto"):
            return
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method: unknown method {self.method!r}; "
                             f"expected one of auto, {', '.join(SPEC_METHODS)}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_DRAFTS[self.method])
        self._check()

    def _check(self) -> None:
        if not _int_at_least(self.num_speculative_tokens, 1):
            raise ValueError("speculative_config.num_speculative_tokens: must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "draft_model" and not (_int_at_least(lo, 1) and _int_at_least(hi, lo)):
            raise ValueError("speculative_config.prompt_lookup_min/max: need integers with "
                             f"1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: method 'draft_model' needs a draft model "
                             "(a model directory, a .gguf file or an alias)")
        for key in ("depth", "topk"):
            value = getattr(self, key)
            if value is not None and not _int_at_least(value, 1):
                raise ValueError(f"speculative_config.{key}: must be an integer >= 1, got {value!r}")
        for key, methods in SPEC_KEY_METHODS.items():  # a key the method would ignore is a mistake
            if key in self.extra and self.method not in methods:
                raise ValueError(f"speculative_config.{key}: applies to method {' or '.join(methods)}, "
                                 f"not {self.method!r}")
        if not _int_at_least(self.extra.get("lookup_branch", 0), 0):
            raise ValueError("speculative_config.lookup_branch: must be an integer >= 0, "
                             f"got {self.extra['lookup_branch']!r}")
        for key in ("min_draft_prob", "fairness"):
            p = self.extra.get(key, 0.0)
            if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p < 1:
                raise ValueError(f"speculative_config.{key}: must be a number in [0, 1), got {p!r}")
        if self.extra.get("quantization", "auto") not in ("auto", "gguf", "int8", "none"):
            raise ValueError("speculative_config.quantization: expected one of auto, gguf, int8, none, "
                             f"got {self.extra['quantization']!r}")
        if "medusa_tree" in self.extra:
            _check_medusa_tree(self.extra["medusa_tree"])
        if not isinstance(self.extra.get("adaptive", True), bool):
            raise ValueError("speculative_config.adaptive: must be true or false")
        if not _int_at_least(self.extra.get("max_match", lo), lo) or self.extra.get("max_match", lo) > MAX_MATCH:
            raise ValueError(f"speculative_config.max_match: must be an integer in [prompt_lookup_min ({lo}), "
                             f"{MAX_MATCH}], got {self.extra['max_match']!r}")
        if not _int_at_least(self.extra.get("corpus_tokens", 0), 0):
            raise ValueError("speculative_config.corpus_tokens: must be an integer >= 0, "
                             f"got {self.extra['corpus_tokens']!r}")
        if not isinstance(self.extra.get("shared_corpus", False), bool):
            raise ValueError("speculative_config.shared_corpus: must be true or false")
        if self.extra.get("lookup", "ngram") not in ("ngram", "suffix"):
            raise ValueError("speculative_config.lookup: expected ngram or suffix, got "
                             f"{self.extra['lookup']!r}")
        unknown = sorted(set(self.extra) - set(SPEC_KEY_METHODS) - set(SPEC_KEYS_ALL_METHODS))
        if unknown:  # vLLM has many more keys; accept them so configs carry over
            logger.warning("speculative_config: ignoring keys %s", ", ".join(unknown))

    @staticmethod
    def parse(value: str | dict | None) -> "SpecConfig":
        """None, "", "none" or {}: no speculation; "auto": the default method; else vLLM's JSON."""
        if value is None or value == {} or (isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
            return SpecConfig()
        if isinstance(value, str) and value.strip().lower() == "auto":
            return SpecConfig(method="auto")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config: expected a JSON object")
        value = dict(value)
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                 "model", "depth", "topk"}
        kwargs = {k: value.pop(k) for k in list(value) if k in known}
        if kwargs.get("method") is None and kwargs.get("model"):
            kwargs["method"] = "draft_model"
        return SpecConfig(**kwargs, extra=value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    @staticmethod
    def create(model: str | None = None, *, dtype: str = "auto", load_format: str = "auto",
               max_model_len: int | None = None, device: str = "auto", seed: int = 0,
               block_size: int = 16, num_blocks: int | None = None,
               kv_cache_memory_gb: float = 1.0, enable_prefix_caching: bool = True,
               max_num_seqs: int = 64, max_num_batched_tokens: int = 1024,
               speculative_config: str | dict | SpecConfig | None = "auto",
               quantization: str | None = None, tensor_parallel_size: int = 1,
               enforce_eager: bool = False, batch_invariant: bool | None = None) -> "EngineConfig":
        if dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: expected 'auto' or 'dummy', got {load_format!r}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {block_size}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be at least 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be at least 1")
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"num_blocks: must be at least 1, got {num_blocks}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len: must be at least 1, got {max_model_len}")
        if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) \
                or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be an integer >= 1, got {tensor_parallel_size!r}")
        quantization = quantization or "none"
        if quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization: expected one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {quantization!r}")
        if quantization != "none":
            from specserve.model.quant import check_target_quantization

            check_target_quantization(quantization, device, dtype)
        spec = speculative_config if isinstance(speculative_config, SpecConfig) \
            else SpecConfig.parse(speculative_config)
        return EngineConfig(
            model=ModelConfig(model or DEFAULT_MODEL, dtype, load_format, max_model_len, device, seed,
                              quantization, tensor_parallel_size, enforce_eager=bool(enforce_eager),
                              batch_invariant=None if batch_invariant is None else bool(batch_invariant)),
            cache=CacheConfig(block_size, num_blocks, kv_cache_memory_gb, enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
            spec=spec,
        )
