"""Engine.step(): schedule -> execute -> sample/verify -> update -> propose.

The Engine is single-threaded and synchronous; the server drives it from its own thread
(specserve.server.async_engine) and the offline API (`LLM`, in specserve.llm) calls step()
until every request has finished. Requests are validated completely in `validate` before
anything is scheduled, so bad input never reaches the scheduler.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from transformers import AutoTokenizer

from specserve.config import QUANTIZATION_NOTE, EngineConfig
from specserve.detokenizer import IncrementalDetokenizer
from specserve.kv_cache.manager import KVCacheManager, cdiv
from specserve.model.arch import ModelArch
from specserve.model.compiled import MAX_WIDTH as MAX_STEP_WIDTH
from specserve.model.loader import canonical_alias, resolve_model_dir
from specserve.model.runner import ModelRunner, kv_bytes_per_block, pick_device, pick_dtype
from specserve.request import (CompletionOutput, Request, RequestOutput, RequestStatus,
                               SamplingParams, TokenLogprob)
from specserve.scheduler.scheduler import Scheduler
from specserve.spec_decode import methods
from specserve.spec_decode.cost_model import LOOKUP_ONLY, SPEC, device_clock
from specserve.structured import Grammars

logger = logging.getLogger(__name__)

MAX_STEP_FAILURES = 3  # failed full batches a request may be in before it is failed itself


@dataclass
class EngineStats:
    """Gauges (current values) and monotonically increasing counters for /metrics and logs."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_steps: int = 0
    num_decode_only_steps: int = 0  # steps without a prefill chunk (every request decoding)
    num_preemptions: int = 0
    num_failed_steps: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_hit_tokens: int = 0
    computed_tokens_total: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # steps with requests to draft for, by the kind the decoder chose (docs/speculation.md):
    # every proposer, prompt-lookup chains alone, or none (measured slower, or a plain sample)
    spec_steps_drafting: int = 0
    spec_steps_lookup_only: int = 0
    spec_steps_plain: int = 0
    cuda_graph_capture_seconds: float = 0.0  # at start (model/cuda_graphs.py); 0 without graphs

    def count_verified(self, drafted: int, accepted: int) -> None:
        """One request's verified draft: `drafted` nodes, the first `accepted` of its path kept."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += drafted
        self.spec_num_accepted_tokens += accepted
        self.spec_accepted_per_pos.extend([0] * (accepted - len(self.spec_accepted_per_pos)))
        for j in range(accepted):
            self.spec_accepted_per_pos[j] += 1

    def count_step_kind(self, kind: int) -> None:
        """A step with requests to draft for, of `kind` (spec_decode.cost_model: PLAIN, SPEC,
        LOOKUP_ONLY)."""
        if kind == SPEC:
            self.spec_steps_drafting += 1
        elif kind == LOOKUP_ONLY:
            self.spec_steps_lookup_only += 1
        else:
            self.spec_steps_plain += 1


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        print(f"[specserve] loading model {mc.model!r} ...", flush=True)
        start = time.time()
        self.model_dir = resolve_model_dir(mc.model)
        self.arch = ModelArch.from_dir(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.max_model_len = min(mc.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        spec_config = methods.resolve(config.spec, mc.model)
        cache = config.cache
        if cache.num_blocks is None:  # one memory budget for the target's KV and a draft model's
            dtype = pick_dtype(mc.dtype, pick_device(mc.device))
            per_block = (kv_bytes_per_block(self.arch, cache.block_size, dtype, mc.tensor_parallel_size)
                         + methods.kv_bytes_per_block(spec_config, self.arch, cache.block_size, dtype))
            cache = replace(cache, num_blocks=max(16, int(cache.kv_cache_memory_gb * (1 << 30)) // per_block))
        if mc.tensor_parallel_size > 1:  # rank 0 of the group; workers started (model/tp_worker.py)
            from specserve.model.tp_worker import start_runner

            self.runner = start_runner(self.model_dir, self.arch, mc, cache, self.max_model_len,
                                       keep_vocab=spec_config.method in ("eagle", "medusa"))
        else:
            self.runner = ModelRunner(self.model_dir, self.arch, mc, cache, self.max_model_len)
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self._stats = EngineStats()
        # an EAGLE-3 head reads inner layers' outputs: every step returns them (set before the
        # compiled step is built)
        self.runner.set_aux_layers(methods.aux_layers(spec_config))
        # the compiled / graph-captured step (model/compiled.py), before the cost model times steps
        sc = config.scheduler
        self.runner.prepare_steps(sc.max_num_seqs, sc.max_num_batched_tokens,
                                  1 if spec_config.method is None else min(MAX_STEP_WIDTH, sc.max_num_batched_tokens))
        self._stats.cuda_graph_capture_seconds = self.runner.graph_capture_seconds
        self.spec = methods.make_decoder(spec_config, self.runner, self.kv, self._stats, mc,
                                         self.max_model_len, config.scheduler)
        # the most tokens (prompt and output) one request can hold: the context, or less when
        # the KV cache is smaller (a request without max_tokens stops there)
        self.max_request_tokens = min(self.max_model_len, self.kv.num_total_blocks * self.kv.block_size
                                      - self.spec.max_drafts - 1)
        self.model_name = canonical_alias(mc.model) or mc.model
        self.model_aliases = [a for a in {mc.model, self.model_dir.name} if a != self.model_name]
        eos = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._aborted: list[Request] = []
        self._quarantine: deque[list[Request]] = deque()  # groups to run alone (see _recover)
        self._passed_at: dict[str, int] = {}  # output tokens of a suspect when it became one
        self._rng = random.Random(mc.seed)
        self._grammars_lock = threading.Lock()
        rows = getattr(self.runner.model, "invariant_rows", 0)  # (a CPU's invariant bfloat16 products)
        print(f"[specserve] model ready in {time.time() - start:.1f} s "
              f"({self.arch.num_layers} layers, vocab {self.arch.vocab_size}, "
              f"{self.runner.num_blocks} KV blocks, {self.runner.device} "
              f"{str(self.runner.dtype).removeprefix('torch.')}"
              f"{QUANTIZATION_NOTE.get(mc.quantization, '')}"
              f"{', batch-invariant' if self.runner.batch_invariant else ''}"
              f"{f' (products in calls of up to {rows} rows)' if rows else ''}"
              f"{f', tensor parallel {mc.tensor_parallel_size}' if mc.tensor_parallel_size > 1 else ''}, speculation: "
              f"{spec_config.method or 'off'})", flush=True)

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 compile_grammar: bool = True) -> None:
        """Raise ValueError('field: reason') for input the engine cannot serve. Safe to call
        from any thread (the server checks requests on its own threads before they reach the
        engine's)."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.arch.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens do not fit the context of {self.max_model_len} "
                             "tokens (max_model_len) with room for one output token")
        if params.logit_bias and any(not isinstance(t, int) or not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be integers in [0, {vocab})")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be integers in [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k: must be at most the vocabulary size {vocab} (or 0 or -1: "
                             f"disabled), got {params.top_k}")
        if n >= self.max_request_tokens:
            raise ValueError(f"prompt: {n} tokens leave no room to generate in the KV cache, "
                             f"which holds {self.max_request_tokens} tokens of one request")
        if params.max_tokens is not None:
            need = cdiv(min(self.max_model_len, n + params.max_tokens) + self.spec.max_drafts + 1,
                        self.kv.block_size)
            if need > self.kv.num_total_blocks:
                raise ValueError(f"max_tokens: prompt plus max_tokens need {need} KV blocks but "
                                 f"the cache has {self.kv.num_total_blocks}")
        if params.structured is not None and compile_grammar:
            self.grammars.compile(params.structured)  # ValueError naming the field

    @property
    def grammars(self) -> Grammars:
        """Structured output's grammar engine, made at the first request that needs it (~1 s;
        the server makes it and compiles each request's grammar on its own threads)."""
        if self.spec.grammars is None:
            with self._grammars_lock:
                if self.spec.grammars is None:
                    self.spec.grammars = Grammars(self.tokenizer, self.arch.vocab_size,
                                                  sorted(self.eos_token_ids))
        return self.spec.grammars

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    tenant: str | None = None) -> None:
        """Queue a request. `tenant`: who sent it (the server's API key); suffix decoding
        drafts only from the outputs of the same tenant's requests."""
        if params.n != 1:
            raise ValueError("n: the engine takes one sequence per request; fan out n above it")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids, seed,
                      arrival_time, prompt, tenant)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop,
                                       params.include_stop_str_in_output, params.skip_special_tokens)
        self.requests[request_id], self._detok[request_id] = req, detok  # nothing above changed state
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        req.status = RequestStatus.FINISHED_ABORTED
        self._finish(req)
        self._aborted.append(req)

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache's blocks that no request holds, so that the next prompts
        prefill from scratch (benchmarks: each run starts cold)."""
        self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        if self.runner.tp is not None:  # a dead tensor-parallel worker ends the engine (WorkerLost)
            self.runner.tp.check()
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also end with this process)."""
        if self.runner.tp is not None:
            self.runner.tp.shutdown()

    @property
    def num_failed_steps(self) -> int:
        """Steps that raised so far (read after every step: no other stats computed)."""
        return self._stats.num_failed_steps

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running, s.num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
        s.kv_cache_usage = self.kv.usage()
        s.num_free_blocks, s.num_total_blocks = self.kv.num_free_blocks, self.kv.num_total_blocks
        s.num_preemptions = self.scheduler.num_preemptions
        return s

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration. A step that raises fails no request by itself: `_recover` takes the
        requests it involved back to their committed tokens and runs them in ever smaller
        groups, alone, until the one that makes steps fail is found and finished with an
        error; everyone else goes on with the same tokens as before."""
        step_start = time.perf_counter()
        outputs = [self._output(r) for r in self._aborted]
        self._aborted = []
        group = self._isolated_group()
        sched = None
        try:
            sched = self.scheduler.schedule(only=group)  # 1. schedule
            for req in sched.preempted:
                self.spec.free(req.request_id)
            if sched.requests:
                self._run(sched, outputs, step_start, group)
        except Exception as e:  # noqa: BLE001 - a step must never fail everyone in it
            self._recover(sched, group, e, outputs)
            return outputs
        if group is not None:  # a suspect passes once it has produced a token alone
            self._quarantine[0] = [r for r in group if r.request_id in self._passed_at
                                   and r.num_output_tokens == self._passed_at[r.request_id]]
            for r in group:
                if r not in self._quarantine[0]:
                    self._passed_at.pop(r.request_id, None)
        return outputs

    def _run(self, sched, outputs: list[RequestOutput], step_start: float, group) -> None:
        start = device_clock(self.runner.device)
        step_logits = self.runner.execute(sched, self.spec.tree_parents(sched))  # 2. execute
        self.spec.observe_forward(sched, device_clock(self.runner.device) - start)  # work, not launches
        emitted = self.spec.sample_and_verify(sched, step_logits)  # 3. sample / verify
        self._stats.num_steps += 1
        self._stats.num_decode_only_steps += sched.decode_only
        self._stats.computed_tokens_total += sched.total_tokens
        for req, n, k, result in zip(sched.requests, sched.num_tokens, sched.num_drafts, emitted):
            req.num_computed_tokens += n  # 4. update
            if result is None:
                continue
            tokens, logprobs = result
            # past the last accepted token, and any slots reserved for drafts not verified
            self.kv.truncate(req, req.num_computed_tokens - (k - (len(tokens) - 1)))
            req.spec_token_ids = []
            self._append(req, tokens, logprobs)
            if req.finished:
                self._finish(req)
            else:
                self.kv.cache_committed_blocks(req)
            outputs.append(self._output(req))
        running = self.scheduler.running if group is None else [r for r in group if r in self.scheduler.running]
        self.spec.propose([r for r in running if not r.finished], step_start)  # 5. propose

    # -- failed steps -----------------------------------------------------------------------------
    def _isolated_group(self) -> list[Request] | None:
        """The requests that run alone this step while a failed step is traced, if any."""
        while self._quarantine:
            group = [r for r in self._quarantine[0] if r.request_id in self._passed_at]
            if group:
                self._quarantine[0] = group
                return group
            self._quarantine.popleft()
        return None

    def _recover(self, sched, group: list[Request] | None, error: Exception,
                 outputs: list[RequestOutput]) -> None:
        """After a step raised: every request it involved back to its committed tokens (KV
        freed, drafts dropped: the preemption path), then traced. A group of several is split
        in two halves that each run alone until every member has produced a token; a request
        that fails alone is finished with finish_reason "error" (the log has the details), and
        so is one that passed alone but was in MAX_STEP_FAILURES failed full batches."""
        self._stats.num_failed_steps += 1
        self.spec.forget_step()
        if group is not None:
            involved = group
        elif sched is not None:
            involved = list(dict.fromkeys(sched.requests + self.scheduler.running))
        else:  # scheduling failed: the running and those it may have been admitting
            involved = self.scheduler.running + list(
                itertools.islice(self.scheduler.waiting, self.config.scheduler.max_num_seqs))
        logger.error("engine step failed with %d request(s) in it (%s); tracing the request "
                     "that makes it fail", len(involved),
                     ", ".join(r.request_id for r in involved[:8]), exc_info=error)
        reported = {o.request_id for o in outputs}
        suspects = []
        for req in involved:
            if req.finished:  # finished within the step before it failed: say so
                if req.request_id in self.requests and req.request_id not in reported:
                    outputs.append(self._output(req))
                continue
            self.scheduler.requeue(req)
            self.spec.free(req.request_id)
            req.num_failed_steps += group is None  # strikes: failed full batches only
            if len(involved) == 1 or req.num_failed_steps >= MAX_STEP_FAILURES:
                outputs.append(self._fail(req))
            else:
                suspects.append(req)
                self._passed_at[req.request_id] = req.num_output_tokens
        if group is not None:
            self._quarantine.popleft()
        half = (len(suspects) + 1) // 2
        for part in (suspects[half:], suspects[:half]):
            if part:
                self._quarantine.appendleft(part)

    def _fail(self, req: Request) -> RequestOutput:
        logger.error("request %s failed: a step fails whenever it is in it", req.request_id)
        req.status = RequestStatus.FINISHED_ERROR
        self._finish(req)
        out = self._output(req)
        out.error = f"internal error while generating this request ({req.request_id})"
        return out

    def _append(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        """Commit the step's tokens; the first stop condition cuts them right there (a stop
        string, then an EOS or stop token, then the length limits, as if one by one)."""
        if req.first_token_time is None:
            req.first_token_time = time.time()
            self._stats.prompt_tokens_total += req.num_prompt_tokens
            self._stats.prefix_cache_hit_tokens += req.num_cached_tokens
        room = min(req.max_tokens - req.num_output_tokens, self.max_request_tokens - req.num_tokens)
        n = min(len(tokens), max(1, room))
        for i in range(n):  # the first EOS or stop token ends the request
            if tokens[i] in req.eos_token_ids or tokens[i] in req.stop_token_ids:
                n = i + 1
                break
        n, stop_str = self._detok[req.request_id].extend(tokens[:n])
        last = tokens[n - 1]
        req.all_token_ids += tokens[:n]
        self._stats.generation_tokens_total += n
        if req.logprobs is not None and logprobs is not None:
            req.logprobs += logprobs[:n]
        if stop_str is not None:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        elif last in req.eos_token_ids or last in req.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = last if last in req.stop_token_ids else None
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_request_tokens:
            req.status = RequestStatus.FINISHED_LENGTH

    def _finish(self, req: Request) -> None:
        req.finished_time = time.time()
        self.scheduler.remove(req)
        if req.status == RequestStatus.FINISHED_ERROR:
            self.spec.free(req.request_id)
        else:
            self.spec.finish(req)
        self._passed_at.pop(req.request_id, None)
        self._detok[req.request_id].flush()

    def _output(self, req: Request) -> RequestOutput:
        """The request's state for its stream: text and token_ids cumulative, logprobs only
        those of the tokens new since its last output."""
        finished = req.finished
        detok = self._detok[req.request_id]
        new_logprobs = req.logprobs
        if new_logprobs is not None:
            req.logprobs = []
        out = RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(
                index=0, text=detok.visible_text(finished), token_ids=req.output_token_ids,
                finish_reason=req.status.value if finished else None,
                stop_reason=req.stop_reason,
                logprobs=new_logprobs)],
            finished=finished, num_cached_tokens=req.num_cached_tokens,
            num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens,
            arrival_time=req.arrival_time, first_token_time=req.first_token_time,
            finished_time=req.finished_time)
        if finished:
            del self.requests[req.request_id]
            del self._detok[req.request_id]
        return out
