"""Our decoder against Hugging Face transformers on the same weights (fp32)."""

import pytest
import torch

from specserve import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "In 1969, astronauts",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\nx = np.arange(10)\n",
    "Question: What is 12 times 7?\nAnswer:",
    "Once upon a time, in a small village by the mountains,",
]


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model


@pytest.fixture(scope="module")
def llm(make_llm):
    """float32, the precision these comparisons are about (auto may pick bfloat16)."""
    return make_llm(max_model_len=2048, dtype="float32", speculative_config=None)


def _our_logits(llm, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Run `ids` through our model in the given prefill chunks; logits of every position."""
    runner, kv = llm.engine.runner, llm.engine.kv
    blocks = kv.pool.allocate(-(-len(ids) // kv.block_size))
    try:
        out, done = [], 0
        for n in chunks:
            meta = runner.backend.build_metadata([done + n], [n], [blocks], kv.block_size, runner.device)
            with torch.inference_mode():
                hidden = runner.model(torch.tensor(ids[done:done + n]), torch.arange(done, done + n),
                                      runner.kv_caches, meta, runner.backend)
                out.append(runner.model.compute_logits(hidden))
            done += n
        return torch.cat(out)
    finally:
        kv.pool.release(blocks)


def test_logits_match_transformers(llm, hf_model):
    ids = llm.get_tokenizer().encode(PROMPTS[5] + " " + PROMPTS[9])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    whole = _our_logits(llm, ids, [len(ids)])
    assert (whole - ref).abs().max().item() < 1e-3
    # chunked prefill and single-token decodes read earlier K/V back through the block table
    n = len(ids)
    chunked = _our_logits(llm, ids, [7, 10, n - 17 - 2, 1, 1])
    assert (chunked - ref).abs().max().item() < 1e-3


def _hf_greedy_choices(hf_model, prompt: list[int], output: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and each prefix of `output` (one forward
    over prompt + output, teacher-forced): equal to `output` exactly when transformers' own greedy
    generation from the prompt would produce `output`, token for token (by induction over
    positions), at one forward's cost instead of one per token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1:-1].argmax(-1).tolist()


def test_greedy_matches_transformers_one_by_one_and_batched(llm, hf_model):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    tok = llm.get_tokenizer()
    single = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    for i, p in enumerate(PROMPTS):
        assert len(single[i]) == 64
        assert _hf_greedy_choices(hf_model, tok.encode(p), single[i]) == single[i], \
            f"prompt {i} one by one differs from transformers"
        assert batched[i] == single[i], f"prompt {i} in a batch differs from one by one"


def test_aux_layer_outputs_match_transformers_hidden_states(llm, hf_model):
    """The outputs of inner layers a step also returns (an EAGLE-3 head's features) are the
    residual stream after those layers, transformers' hidden_states[i + 1]."""
    from specserve.kv_cache.manager import KVCacheManager
    from specserve.request import Request
    from specserve.scheduler.scheduler import SchedulerOutput

    ids = llm.get_tokenizer().encode(PROMPTS[6])
    runner = llm.engine.runner
    layers = (2, 15, 27)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    kv = KVCacheManager(8, llm.engine.kv.block_size, enable_prefix_caching=False)
    req = Request("aux", ids, SamplingParams(temperature=0), set(), 0)
    kv.allocate(req, len(ids))
    runner.model.aux_layers = layers  # (the eager step: no compiled graphs to rebuild)
    try:
        step = runner.execute(SchedulerOutput([req], [len(ids)], [0]))
    finally:
        runner.model.aux_layers = ()
    width = runner.arch.hidden_size
    aux = step.features[:, width:]
    assert aux.shape == (len(ids), 3 * width) and step.all_hidden.shape == (len(ids), width)
    for j, i in enumerate(layers):
        torch.testing.assert_close(aux[:, j * width:(j + 1) * width], ref[i + 1][0], atol=1e-3, rtol=1e-4)
    assert (step.all_hidden - ref[-1][0]).abs().max().item() < 1e-3
