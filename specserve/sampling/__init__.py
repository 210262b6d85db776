"""Sampling: plain batched sampling (sampler.py) and lossless verification of draft trees
(rejection.py), which is plain sampling for a request without drafts."""

from specserve.sampling.rejection import FlatTrees, TreeVerdict, verify_targets, verify_trees
from specserve.sampling.sampler import (SamplingBatch, TokenCounts, apply_penalties, c_rows, draft_top_k,
                                        exponential_noise, gather_logprobs, processed_probs, row_argmax,
                                        row_counts, sample, top_logprobs, uniform_at, uniform_noise)

__all__ = ["FlatTrees", "TreeVerdict", "verify_targets", "verify_trees", "SamplingBatch", "TokenCounts",
           "apply_penalties", "c_rows", "draft_top_k", "exponential_noise", "gather_logprobs", "processed_probs",
           "row_argmax", "row_counts", "sample", "top_logprobs", "uniform_at", "uniform_noise"]
