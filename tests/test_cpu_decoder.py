"""Every decoder layer of a CPU float32 model in one C call (specserve/kernels/cpu/decoder.c,
LlamaForCausalLM.decoder): the same bits as the layer-by-layer path, in every kind of step and
weight format, and used wherever every layer is our kernels alone."""

import pytest
import torch

from specserve.config import CacheConfig, ModelConfig
from specserve.kernels.cpu import decoder
from specserve.kv_cache.manager import KVCacheManager
from specserve.model.arch import ModelArch
from specserve.model.runner import ModelRunner
from specserve.request import Request, SamplingParams
from specserve.scheduler.scheduler import SchedulerOutput

pytestmark = pytest.mark.skipif(not decoder.available(), reason="the CPU kernels cannot run here")

BLOCKS = 64


def make_runner(model_dir, quantization: str = "none", aux_layers: tuple[int, ...] = ()):
    runner = ModelRunner(model_dir, ModelArch.from_dir(model_dir), ModelConfig(quantization=quantization),
                         CacheConfig(num_blocks=BLOCKS), 1024)
    if aux_layers:
        runner.set_aux_layers(aux_layers)
    return runner, KVCacheManager(BLOCKS, runner.block_size, enable_prefix_caching=False)


def both_paths(runner, sched, tree_parents=None):
    """The step through the layer-by-layer path and through the C decoder, each from the same
    KV caches -> [(features, logits, k_cache, v_cache)] for each; the caches left as the
    decoder's step wrote them."""
    fused = runner.model.decoder
    assert fused is not None
    k0, v0 = runner.k_cache.clone(), runner.v_cache.clone()
    results = []
    for path in (None, fused):
        runner.k_cache.copy_(k0), runner.v_cache.copy_(v0)
        runner.model.decoder = path
        step = runner.execute(sched, tree_parents)
        results.append((step.features.clone(), step.logits.clone(), runner.k_cache.clone(), runner.v_cache.clone()))
    runner.model.decoder = fused
    return results


def assert_same_bits(results):
    (a, b) = results
    for name, x, y in zip(("features", "logits", "k_cache", "v_cache"), a, b):
        assert torch.equal(x, y), name


def requests(kv, lengths: list[int], seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i, n in enumerate(lengths):
        req = Request(f"r{i}", torch.randint(3, 400, (n,), generator=g).tolist(), SamplingParams(), set(), 0)
        kv.allocate(req, n + 24)
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("quantization, aux", [("none", ()), ("none", (0,)), ("int8", ()), ("gguf", (1,))])
def test_the_c_decoder_computes_the_layer_paths_bits(tiny_model_dir, quantization, aux):
    """Prefill chunks (one of more rows than an attention run takes), decodes of several
    requests, a chain and a tree verified: outputs, aux layers' outputs and the K/V written,
    bit for bit."""
    runner, kv = make_runner(tiny_model_dir, quantization, aux)
    reqs = requests(kv, [40, 23, 9])
    # prefill: 37 rows of the first, all of the second, 5 of the third
    assert_same_bits(both_paths(runner, SchedulerOutput(reqs, [37, 23, 5], [0, 0, 0])))
    for req, n in zip(reqs, (37, 23, 5)):
        req.num_computed_tokens = n
    # the rest of the prompts beside a decode
    reqs[1].all_token_ids.append(17)  # its first output token
    assert_same_bits(both_paths(runner, SchedulerOutput(reqs, [3, 1, 4], [0, 0, 0])))
    for req, n in zip(reqs, (3, 1, 4)):
        req.num_computed_tokens += n
    # verify: a chain of 3 drafts, a tree of 5 nodes, a plain decode
    for req, drafts in zip(reqs, ([5, 6, 7], [8, 9, 10, 11, 12], [])):
        req.all_token_ids.append(18)  # each one's last sampled token
        req.spec_token_ids = drafts
    tree = [None, [-1, 0, 0, 1, 1, 2], None]  # the root, then each node's parent
    assert_same_bits(both_paths(runner, SchedulerOutput(reqs, [4, 6, 1], [3, 5, 0]), tree))
    for req in reqs:
        kv.free(req)


def test_the_default_model_decodes_through_the_c_decoder_with_the_same_bits(default_model_dir):
    """The default model's GGUF blocks (Q4_1 and Q8_0 products) and head shape: a batch of
    decodes and a verify of 20 rows (two attention runs)."""
    runner, kv = make_runner(default_model_dir)
    reqs = requests(kv, [30, 50], seed=1)
    runner.execute(SchedulerOutput(reqs, [30, 50], [0, 0]))
    for req in reqs:
        req.num_computed_tokens = req.num_tokens
        req.all_token_ids.append(7)
    reqs[0].spec_token_ids = list(range(100, 119))
    assert_same_bits(both_paths(runner, SchedulerOutput(reqs, [20, 1], [19, 0])))
    for req in reqs:
        kv.free(req)


def test_a_layer_the_c_decoder_does_not_cover_keeps_the_layer_path(tiny_model_dir):
    """A product that is not our kernel (here: one layer's MLP output through PyTorch's GEMM)
    leaves the model on the layer-by-layer path, as does use_layer_ops(False)."""
    runner, _ = make_runner(tiny_model_dir)
    model = runner.model
    assert model.decoder is not None
    model.use_layer_ops(False)
    assert model.decoder is None
    down = model.layers[1].mlp.down_proj
    down.packed, down.weight = None, torch.nn.Parameter(torch.zeros(down.out_features, down.in_features),
                                                        requires_grad=False)
    model.use_layer_ops(True)
    assert model.decoder is None
