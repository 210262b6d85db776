"""Offline API with vLLM's names: LLM(model=...).generate(prompts, SamplingParams(...)).

Every prompt and parameter set is validated before the first request is scheduled, so a bad
input raises ValueError and nothing runs. n > 1 is fanned out into n engine requests (seed + i
for a seeded request) and gathered back into one RequestOutput with n completions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from specserve.config import EngineConfig
from specserve.engine import Engine
from specserve.request import RequestOutput, SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, *, speculative_config: dict | str | None = "auto",
                 **engine_args: Any) -> None:
        self.engine = Engine(EngineConfig.create(model, speculative_config=speculative_config,
                                                 **engine_args))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError("sampling_params: need one per prompt or a single one")
        encoded = [self._encode(p) for p in prompts]
        for (ids, _), p in zip(encoded, params):
            self.engine.validate(ids, p)
        return self._run(encoded, params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            raise ValueError("messages: must not be empty")
        prompts = [self.apply_chat_template(c, add_generation_prompt, **(chat_template_kwargs or {}))
                   for c in conversations]
        return self.generate([{"prompt_token_ids": ids} for ids in prompts], sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache (blocks held by running requests stay), as vLLM's LLM does."""
        self.engine.reset_prefix_cache()

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        if not conversation:
            raise ValueError("messages: must not be empty")
        for m in conversation:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"messages: unknown role in {m!r}")
        ids = self.engine.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _encode(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                return self._encode(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        raise ValueError(f"prompt: unsupported prompt type {type(prompt).__name__}")

    def _run(self, encoded, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        groups: list[list[str]] = []
        for (ids, text), p in zip(encoded, params):
            ids_of_group = []
            for i in range(p.n):
                child = _child_params(p, i)
                rid = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, ids, child, prompt=text)
                ids_of_group.append(rid)
            groups.append(ids_of_group)
        finished: dict[str, RequestOutput] = {}
        logprobs: dict[str, list] = {}  # engine outputs carry new logprobs only
        bar = tqdm(total=sum(len(g) for g in groups), desc="Generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    c = out.outputs[0]
                    if c.logprobs is not None:
                        logprobs.setdefault(out.request_id, []).extend(c.logprobs)
                        c.logprobs = logprobs[out.request_id]
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for g in groups:
                for rid in g:
                    self.engine.abort_request(rid)
            self.engine.step()
            raise
        finally:
            bar.close()
        return [_merge([finished[r] for r in g]) for g in groups]


def _child_params(p: SamplingParams, i: int) -> SamplingParams:
    if p.n == 1:
        return p
    from dataclasses import replace

    return replace(p, n=1, seed=None if p.seed is None else p.seed + i)


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    first = outs[0]
    if len(outs) == 1:
        return first
    completions = []
    for i, o in enumerate(outs):
        c = o.outputs[0]
        c.index = i
        completions.append(c)
    first.outputs = completions
    first.num_draft_tokens = sum(o.num_draft_tokens for o in outs)
    first.num_accepted_tokens = sum(o.num_accepted_tokens for o in outs)
    return first
