"""How close `--quantization gguf` (int8 activations against the GGUF blocks), `--quantization
int8` (int8 weights) and `--dtype bfloat16` stay to the default float32 model: the float32
model's greedy answers to bench load's held-out prompts, then every model teacher-forced over
prompt + answer in one forward; per answer position, whether its argmax is the float32 model's
token (top-1 agreement), the KL divergence from the float32 distribution to its, and the
float32 token's log-probability under it.

    python benchmarks/experiments/gguf_agreement.py [--prompts 24] [--max-tokens 128] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def answer_logits(llm, ids: list[int], start: int):
    """log-softmax of the model's logits at positions start-1 .. len(ids)-2 (those predicting
    ids[start:]), from one forward over `ids` through the engine's runner."""
    import torch

    from specserve.request import Request, SamplingParams
    from specserve.scheduler.scheduler import SchedulerOutput

    engine = llm.engine
    kv, runner = engine.kv, engine.runner
    req = Request("agreement", list(ids), SamplingParams(), set(), 0)
    kv.allocate(req, len(ids))
    try:
        step = runner.execute(SchedulerOutput([req], [len(ids)], [0]))
        hidden = step.all_hidden[start - 1:len(ids) - 1]
        return torch.log_softmax(runner.model.compute_logits(hidden).double(), -1)
    finally:
        kv.free(req)


def main() -> None:
    import torch

    from specserve import LLM, SamplingParams
    from specserve.bench.load import encode, load_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    kw = {"speculative_config": None, "enable_prefix_caching": False, "max_model_len": 2048}
    models = {"float32": LLM(None, dtype="float32", **kw), "gguf": LLM(None, quantization="gguf", **kw),
              "int8": LLM(None, quantization="int8", **kw), "bfloat16": LLM(None, dtype="bfloat16", **kw)}
    reference = models["float32"]
    prompts = encode(reference, load_prompts("heldout")[:args.prompts], args.max_tokens, 2048)
    answers = [o.outputs[0].token_ids for o in reference.generate(
        [{"prompt_token_ids": ids} for ids in prompts], SamplingParams(temperature=0, max_tokens=args.max_tokens))]
    result = {}
    ref_logits = [answer_logits(reference, ids + ans, len(ids)) for ids, ans in zip(prompts, answers)]
    for name, llm in models.items():
        same = total = 0
        kl = logp = 0.0
        for ids, ans, ref in zip(prompts, answers, ref_logits):
            lp = ref if name == "float32" else answer_logits(llm, ids + ans, len(ids))
            tokens = torch.tensor(ans)
            same += int((lp.argmax(-1) == tokens).sum())
            total += len(ans)
            kl += float((ref.exp() * (ref - lp)).sum())
            logp += float(lp.gather(1, tokens[:, None]).sum())
        result[name] = {"top1_agreement": same / total, "mean_kl": kl / total, "mean_logprob": logp / total,
                        "positions": total}
        print(f"{name:>9}: top-1 agreement {same / total:.4f}, mean KL {kl / total:.5f} nats, "
              f"mean log-prob of the float32 token {logp / total:.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    import torch

    with torch.inference_mode():
        main()
