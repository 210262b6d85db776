"""Greedy rows' LM head (cpu_linear.ArgmaxHead, q8_0_argmax_head in cpu_linear.c): the int8
product, then exact float32 products of only the blocks that may hold a row's largest value;
the argmax is always the full float32 product's."""

import pytest
import torch

from specserve import SamplingParams
from specserve.kernels.cpu import cpu_linear
from specserve.model.runner import argmax_is_all
from test_quant import gguf_like

pytestmark = pytest.mark.skipif(not (cpu_linear.available() and cpu_linear.a8_available()),
                                reason=f"the CPU kernels cannot run here ({cpu_linear.a8_why_unavailable()})")


@pytest.fixture(params=[(False, False), (True, True)], ids=["avx2", "avx512+vnni"])
def isas(request):
    """The exact products and the int8 ones with AVX2, then with AVX-512 / AVX512-VNNI where
    the CPU has them; the kernels' own choices restored after."""
    wide, vnni = cpu_linear.wide(), cpu_linear.a8_vnni()
    want = request.param
    if cpu_linear.wide(want[0]) != want[0] or cpu_linear.a8_vnni(want[1]) != want[1]:
        cpu_linear.wide(wide), cpu_linear.a8_vnni(vnni)
        pytest.skip("no AVX-512F / AVX512-VNNI on this CPU")
    yield request.param
    cpu_linear.wide(wide), cpu_linear.a8_vnni(vnni)


def head(n: int = 700, k: int = 192, seed: int = 0):
    w = gguf_like("q8_0", n, k, seed=seed)
    exact = cpu_linear.pack_float32(w, None)
    assert exact.format == "q8_0"
    return w, exact, cpu_linear.ArgmaxHead(exact, w)


def hidden_like(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations with a few outlier channels, as a final norm's output has."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, k, generator=g) * 2
    x[:, 5] *= 40
    x[:, 100] *= 15
    return x


def test_the_argmax_is_the_float32_products_on_every_row(isas):
    w, exact, fast = head()
    x = hidden_like(300, 192)
    x[7] = 0  # every logit 0: the first column
    x[8, :32] = 0  # a block of zeros (scale 0)
    x[9] = w[123] * 50  # one column far ahead: few blocks exact
    full, y = exact(x), fast(x)
    assert torch.equal(y.argmax(-1), full.argmax(-1))
    top = full.argmax(-1)
    rows = torch.arange(len(x))
    assert torch.equal(y[rows, top], full[rows, top])  # computed exactly, bit for bit
    assert (y - full).abs().max() < 0.05 * full.abs().max()  # the rest: the int8 approximation
    assert fast.exact_blocks < len(x) * 11  # (700 columns: 11 blocks a row)
    fast.exact_blocks = 0
    fast(x[9:10])
    assert fast.exact_blocks == 1
    for rows in (1, 2, 5, 17):  # a row's result does not depend on the rows beside it
        assert torch.equal(fast(x[20:20 + rows]), y[20:20 + rows])


def test_ties_and_near_ties_pick_what_the_full_product_picks():
    w = gguf_like("q8_0", 640, 128, seed=1)
    w[600] = w[37]  # the same column twice: the first wins
    w[300] = w[37]
    exact = cpu_linear.pack_float32(w, None)
    fast = cpu_linear.ArgmaxHead(exact, w)
    x = w[37].repeat(4, 1) * 30 + torch.randn(4, 128) * 0.01
    full, y = exact(x), fast(x)
    assert torch.equal(y.argmax(-1), full.argmax(-1)) and bool((full.argmax(-1) == 37).all())
    # near ties: columns that differ in one weight by a step of its block's scale
    for trial in range(20):
        g = torch.Generator().manual_seed(trial)
        x = torch.randn(8, 128, generator=g)
        full = exact(x)
        assert torch.equal(fast(x).argmax(-1), full.argmax(-1)), trial


def test_values_that_are_not_finite_take_the_full_product():
    w, exact, fast = head(n=200, k=64, seed=2)
    x = torch.randn(3, 64)
    x[0, 3] = float("nan")
    x[1, 10] = float("inf")
    full, y = exact(x), fast(x)
    assert torch.equal(y[:2].isnan(), full[:2].isnan())
    finite = full[:2].isfinite()
    assert torch.equal(y[:2][finite], full[:2][finite])
    assert torch.equal(y[2].argmax(), full[2].argmax())


def test_only_q8_0_heads():
    w = gguf_like("q4_1", 64, 64)
    with pytest.raises(ValueError, match="Q8_0"):
        cpu_linear.ArgmaxHead(cpu_linear.pack_float32(w, None), w)


def test_which_requests_read_only_the_argmax():
    from specserve.structured import StructuredOutput

    assert argmax_is_all(SamplingParams(temperature=0))
    assert argmax_is_all(SamplingParams(temperature=0, stop=["x"], ignore_eos=True))
    for p in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=0, repetition_penalty=1.1), SamplingParams(temperature=0, logit_bias={3: 1}),
              SamplingParams(temperature=0, min_tokens=4),
              SamplingParams(temperature=0, structured=StructuredOutput(regex="[ab]+"))):
        assert not argmax_is_all(p), p


def test_the_default_model_decodes_the_same_with_either_head(llm, make_llm):
    """Greedy, plain and speculative, and a batch that mixes greedy rows with a sampled request
    and one asking for logprobs: the same tokens and logprobs as through the full head."""
    model = llm.engine.runner.model
    if model.argmax_head is None:
        pytest.skip("the default model's head is not in Q8_0 blocks here")
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    mixed = [greedy, SamplingParams(temperature=0.8, seed=7, max_tokens=24),
             SamplingParams(temperature=0, max_tokens=24, logprobs=2)]
    head = model.argmax_head
    blocks = head.exact_blocks
    fast_plain = llm.generate(prompts, greedy)
    assert head.exact_blocks > blocks  # greedy rows took the argmax head
    blocks = head.exact_blocks
    llm.generate(prompts[:2], mixed[1:])  # a sampled request and one with logprobs: the full head
    assert head.exact_blocks == blocks
    fast_mixed = llm.generate(prompts, mixed)
    spec = make_llm(max_model_len=2048, speculative_config={"method": "ngram"})
    fast_spec = spec.generate(prompts, greedy)
    model.argmax_head = None
    try:
        full_plain = llm.generate(prompts, greedy)
        full_mixed = llm.generate(prompts, mixed)
    finally:
        model.argmax_head = head
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    assert ids(fast_plain) == ids(full_plain) == ids(fast_spec)
    assert ids(fast_mixed) == ids(full_mixed)
    lp = lambda o: [(t.token_id, t.logprob, t.top) for t in o.outputs[0].logprobs]  # noqa: E731
    assert lp(fast_mixed[2]) == lp(full_mixed[2])
