"""SpecDecoder: the speculative half of Engine.step(), one path for every method.

Every engine has one, speculating or not. Per step:
  * `tree_parents(sched)`: each request's verify rows as a tree for the target forward (root:
    its last committed token; then the drafts the scheduler kept), None for chains;
  * `sample_and_verify(sched, step)`: every row of every request in one batched call of
    specserve.sampling.verify_trees (no drafts: plain sampling); accepted paths' KV moved into
    place in one call per layer; the proposer shown the new target features (but those it will
    not need: `_unseen`); the policy
    learns from what was accepted;
  * `propose(running)`: drafts for the next step: a proposer with a cost per request where the
    policy says it pays, prompt lookup (grafted onto every tree) for every request; then the
    policy keeps the nodes worth their rows over the whole batch (spec_decode.policy).
Per-request state lives in `self.states`, from a request's first step until `free`.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from specserve.host import int_tensor
from specserve.metrics import SpecLog
from specserve.model.runner import StepLogits
from specserve.request import Request, TokenLogprob
from specserve.sampling import FlatTrees, TokenCounts, gather_logprobs, verify_targets, verify_trees
from specserve.scheduler.scheduler import SchedulerOutput
from specserve.spec_decode.draft_tree import DraftTree, ProposeBatch, Proposer, preorder
from specserve.spec_decode.cost_model import PLAIN, SPEC, device_clock
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.policy import PROBE_FIRST, PROBE_MAX, RequestState, SpecPolicy
from specserve.structured import Grammars, constrain, cut

StepResult = tuple[list[int], list[TokenLogprob] | None] | None
NO_DRAFTS = DraftTree([], [])


class SpecDecoder:
    def __init__(self, runner, kv, stats, max_model_len: int, max_num_batched_tokens: int,
                 proposer: Proposer | None = None, lookup: NgramProposer | None = None,
                 policy: SpecPolicy | None = None, max_drafts: int = 0) -> None:
        self.runner, self.kv, self.stats, self.vocab_size = runner, kv, stats, runner.arch.vocab_size
        self.max_model_len, self.max_rows = max_model_len, max_num_batched_tokens
        self.proposer, self.lookup = proposer, lookup
        self.policy = policy or SpecPolicy(None, 1, adaptive=False)
        self.max_drafts = max_drafts if (proposer or lookup) else 0
        # a model drafts (EAGLE, medusa, a draft model): gated per request, its cost measured
        self._model_drafts = bool(getattr(proposer, "costs_per_request", False))
        # steps with the lookup chains alone are a kind of their own (Realized's LOOKUP_ONLY)
        # where a proposer with a cost per request drafts beside them
        self._fallback = lookup is not None and self._model_drafts
        # prompt lookup alone or suffix decoding: no drafting step costs model time
        self.policy.realized.free = frozenset() if self._model_drafts else frozenset([SPEC])
        self.states: dict[str, RequestState] = {}
        self._gate_seen: set[str] = set()  # requests the speculation gate has counted (Realized.new_requests)
        self._num_drafted = 1  # requests the proposer drafted for last step (its cost share)
        self._drafted_last: set[str] = set()  # the requests it drafted for in the step before (see _draft)
        self._interval: tuple[float, int, bool, bool] | None = None  # from propose to propose
        self._busy = 0.0  # seconds inside engine steps so far: the clock of _interval
        self._step: tuple[bool, int, int] = (False, 0, 0)  # decode only, requests, tokens emitted
        self._slowdown = 1.0  # the next step's predicted time in plain steps (SpecPolicy.slowdown)
        self.log = SpecLog()  # acceptance every few seconds while drafting
        self.grammars: Grammars | None = None  # set by the engine at the first structured request
        self._trees: tuple[SchedulerOutput, list[DraftTree]] | None = None  # this step's, see _scheduled_trees

    def _state(self, req: Request) -> RequestState:
        state = self.states.get(req.request_id)
        if state is None:
            state = self.states[req.request_id] = self.policy.new_state()
            if req.params.structured is not None:
                state.grammar = self.grammars.matcher(req.params.structured)
                state.grammar.consume(req.output_token_ids)
        return state

    def finish(self, req: Request) -> None:
        """A request finished: a proposer that learns across requests keeps its output (suffix
        decoding's corpus), then the request is freed."""
        for proposer in filter(None, (self.proposer, self.lookup)):
            remember = getattr(proposer, "remember", None)
            if remember is not None and req.num_output_tokens:
                remember(req.request_id, req.output_token_ids, req.tenant)
        self.free(req.request_id)

    def free(self, request_id: str) -> None:
        """A request finished, or preempted (its drafts and every cache of it are gone; what
        it needs again is rebuilt from its tokens)."""
        self.states.pop(request_id, None)
        self._gate_seen.discard(request_id)
        for proposer in filter(None, (self.proposer, self.lookup)):
            proposer.free(request_id)

    def forget_step(self) -> None:
        """A step failed part way: nothing of it is kept (its requests are `free`d next)."""
        self._trees = None
        self._interval = None

    def observe_forward(self, sched: SchedulerOutput, seconds: float) -> None:
        """The target forward's time: decode-only steps teach the cost model."""
        if self.policy.adaptive and sched.decode_only:
            self.policy.cost.observe(len(sched), sched.total_tokens, seconds)

    def _scheduled_trees(self, sched: SchedulerOutput) -> list[DraftTree]:
        """Every scheduled request's drafts that the scheduler kept, its tree's first k nodes
        (parents come first), made once per step."""
        if self._trees is None or self._trees[0] is not sched:
            self._trees = (sched, [self.states[r.request_id].tree.prefix(k) if k else NO_DRAFTS
                                   for r, k in zip(sched.requests, sched.num_drafts)])
        return self._trees[1]

    def tree_parents(self, sched: SchedulerOutput) -> list[list[int] | None] | None:
        out = [None if tree.is_chain else [-1] + [p + 1 for p in tree.parents] for tree in self._scheduled_trees(sched)]
        return out if any(p is not None for p in out) else None

    # -- sampling and verification ---------------------------------------------------------------
    def sample_and_verify(self, sched: SchedulerOutput, step: StepLogits) -> list[StepResult]:
        live = [i for i, s in enumerate(step.row_start) if s >= 0]
        reqs = [sched.requests[i] for i in live]
        scheduled = self._scheduled_trees(sched)
        trees = [scheduled[i] for i in live]
        self._trees = None  # (the states move on below)
        results: list[StepResult] = [None] * len(sched.requests)
        verdict = None
        if reqs:
            starts = [step.row_start[i] for i in live]
            target, exact, seeds, row_pos, all_exact, coupled = self._target(step.logits, reqs, trees, starts)
            flat = FlatTrees(starts, [(t.tokens, t.parents, t.probs) for t in trees], self.vocab_size,
                             step.logits.device)
            verdict = verify_trees(target, exact, seeds, row_pos, flat, all_exact, coupled)
            self._compact(sched, live, verdict.accepted)
            for j, (req, tree, i) in enumerate(zip(reqs, trees, live)):
                path = verdict.accepted[j]
                tokens = [tree.tokens[n] for n in path] + [verdict.final[j]]
                results[i] = (tokens, None)
                if req.params.structured is not None:
                    self._state(req).grammar.consume(tokens)
                self._learn(req, tree, path, len(sched))
            self._logprobs(reqs, live, trees, verdict.accepted, step, results)
        self._slowdown = 1.0
        self._step = (sched.decode_only, len(sched), sum(len(r[0]) for r in results if r is not None))
        if self.proposer is not None and self.proposer.needs_hidden:
            self._show_features(sched, step, live, verdict.accepted if verdict else [])
        return results

    def _unseen(self, sched: SchedulerOutput) -> Callable[[Request], bool]:
        """Which decode rows' features can go unseen this step: those of requests the proposer
        will not draft for within the features it needs to draft as it would have
        (`feature_steps`): every request where the batch size's steps with it measured slower
        and its next probe is further off (cost_model.Realized.quiet), else each request whose
        own gate is off and its next probe further off. A prefill chunk's features (a new
        request's prompt) are always shown. At 64 in flight on an H100 showing them cost ~0.5 ms
        of host work a step against a 5.3 ms plain step."""
        if not self.policy.adaptive:
            return lambda req: False
        horizon = self.proposer.feature_steps
        if self.policy.realized.quiet(len(sched), horizon):
            return lambda req: True
        states = self.states

        def gated_off(req: Request) -> bool:
            state = states.get(req.request_id)
            return state is not None and not state.gate.on and state.gate.interval - state.gate.idle > horizon
        return gated_off

    def _target(self, logits: torch.Tensor, reqs: list[Request], trees: list[DraftTree], starts: list[int]):
        """The verify target of every row (specserve.sampling.verify_targets), after the
        grammar's masks, logit_bias and min_tokens (specserve.structured.constrain)."""
        logits = constrain(logits, reqs, [self._state(r) if r.params.structured else None for r in reqs],
                           trees, starts, self.vocab_size)
        counts = [self._counts(r, logits.device) for r in reqs] if any(r.params.has_penalties for r in reqs) else None
        return verify_targets(logits, reqs, [(t.tokens, t.parents) for t in trees], counts, self.vocab_size)

    def _counts(self, req: Request, device) -> TokenCounts:
        state = self._state(req)
        if state.counts is None:
            state.counts = TokenCounts(req.prompt_token_ids, self.vocab_size, device)
        return state.counts

    def _compact(self, sched: SchedulerOutput, live: list[int], accepted: list[list[int]]) -> None:
        """Move every accepted path's KV next to its root (one call per layer for the step)."""
        bs, src, dst = self.kv.block_size, [], []
        for i, path in zip(live, accepted):
            req = sched.requests[i]
            root = req.num_computed_tokens + sched.num_tokens[i] - sched.num_drafts[i] - 1
            for j, node in enumerate(path):
                s, d = root + node + 1, root + j + 1
                if s != d:
                    src.append(req.block_ids[s // bs] * bs + s % bs)
                    dst.append(req.block_ids[d // bs] * bs + d % bs)
        if src:
            self.runner.move_kv(src, dst)

    def _learn(self, req: Request, tree: DraftTree, path: list[int], batch: int) -> None:
        if not self.max_drafts:  # not speculating
            return
        state = self._state(req)
        if self.policy.adaptive:  # its lead over plain decoding: the path, the bonus token, the step's time
            self.policy.advance(state, len(path) + 1, self._slowdown)
        if state.drafted and not len(tree):  # drafted, but none of it was worth verifying: no gain
            self.policy.refused(state, batch)
        if len(tree):
            req.num_draft_tokens += len(tree)
            req.num_accepted_tokens += len(path)
            self.stats.count_verified(len(tree), len(path))
            if self.policy.adaptive:
                self.policy.observe(state, tree, path, [n for n in state.chain_nodes if n < len(tree)])
            state.unverified = 0
            state.probe_every = PROBE_FIRST if path else min(PROBE_MAX, 2 * state.probe_every)
        state.tree, state.chain_nodes, state.drafted, state.masks = None, [], False, None

    def _logprobs(self, reqs, live, trees, accepted, step: StepLogits, results) -> None:
        want = [j for j, r in enumerate(reqs) if r.params.logprobs is not None]
        if not want:
            return
        rows, ids, top = [], [], []
        for j in want:
            start, tokens = step.row_start[live[j]], results[live[j]][0]
            rows += [start] + [start + 1 + n for n in accepted[j]]
            ids += tokens
            top += [reqs[j].params.logprobs] * len(tokens)
        rows_ids = int_tensor([rows, ids], step.logits.device)  # one tensor call, not two
        lps = gather_logprobs(step.logits.index_select(0, rows_ids[0]), rows_ids[1], top)
        at = 0
        for j in want:
            tokens = results[live[j]][0]
            results[live[j]] = (tokens, lps[at:at + len(tokens)])
            at += len(tokens)

    def _show_features(self, sched, step: StepLogits, live: list[int], accepted: list[list[int]]) -> None:
        """The target features of every newly computed committed token: prefill chunks, roots
        and accepted paths (but the decode rows of requests it will not draft for soon: `_unseen`)."""
        paths, unseen = dict(zip(live, accepted)), self._unseen(sched)
        index, ids, starts, sizes, off = [], [], [], [], 0
        for i, (req, n, k) in enumerate(zip(sched.requests, sched.num_tokens, sched.num_drafts)):
            if n - k == 1 and req.num_output_tokens and unseen(req):  # a decode row it will not need
                off += n
                continue
            # (mid-prefill: no drafts, no path, every row committed)
            committed = list(range(off, off + n - k)) + [off + n - k + node for node in paths.get(i, ())]
            index += committed
            ids.append(req.request_id)
            starts.append(req.num_computed_tokens)
            sizes.append(len(committed))
            off += n
        # [off, hidden]: every row of the step (then the aux layers' outputs, which the model
        # returns only for a proposer that reads them: methods.aux_layers)
        hidden = step.features
        if not index:
            return
        if len(index) < off:  # drafts not accepted, or rows unseen
            # index is increasing: a run of rows (first-choice paths accepted) is a view
            first = index[0]
            hidden = (hidden[first:first + len(index)] if index[-1] - first == len(index) - 1
                      else hidden.index_select(0, int_tensor(index, hidden.device)))
        self.proposer.observe(ids, starts, sizes, hidden)

    # -- drafting --------------------------------------------------------------------------------
    def propose(self, running: list[Request], step_start: float) -> None:
        """Drafts for the next step; called last in an engine step that began at `step_start`
        (perf_counter), so that Realized times the engine's own steps only, not whatever runs
        between them (another engine, an idle server)."""
        if self.max_drafts:  # speculating
            try:
                self._propose(running, step_start)
            finally:
                self._busy += time.perf_counter() - step_start

    def _propose(self, running: list[Request], step_start: float) -> None:
        batch = len(running)
        eligible = []
        for req in running:
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            if req.num_output_tokens and req.num_computed_tokens == req.num_tokens - 1 and room >= 1:
                eligible.append((req, room))
        if self.policy.adaptive and eligible:  # requests the gate has not seen yet: see Realized
            new = [r.request_id for r, _ in eligible if r.request_id not in self._gate_seen]
            if new:
                self._gate_seen.update(new)
                self.policy.realized.new_requests(len(new), batch)
        kind = (self._speculate(batch, bool(eligible), step_start) if self.policy.adaptive
                else SPEC if eligible else PLAIN)
        if eligible:
            self.stats.count_step_kind(kind)
        if kind == PLAIN:
            self._drafted_last = set()
            return  # nothing to draft for, a plain step to measure, or speculation measured slower
        states = [self._state(r) for r, _ in eligible]
        chains = None
        if self.lookup is not None:
            chains = self.lookup.lookup([r.request_id for r, _ in eligible], [r.all_token_ids for r, _ in eligible],
                                        [min(self.lookup.k, room) for _, room in eligible],
                                        [r.tenant for r, _ in eligible])
        if self.proposer is not None and kind == SPEC:
            trees = self._draft(eligible, states, batch, chains)
        else:  # (LOOKUP_ONLY: the per-request proposer measured slower, its chains did not)
            trees, self._drafted_last = [None] * len(eligible), set()
        for j, chain in enumerate(chains or ()):
            if chain:
                trees[j], states[j].chain_nodes = (trees[j] or NO_DRAFTS).graft(chain)
        self._select(eligible, states, trees, batch)
        self.log.maybe(self.stats)

    def _speculate(self, batch: int, eligible: bool, step_start: float) -> int:
        """Closes the last propose-to-propose interval (a sample of cost_model.Realized when its
        step decoded the batch it was proposed for) and decides the next step's kind: PLAIN when
        the cost model wants a plain step or when the measured rates say speculation loses,
        LOOKUP_ONLY where the per-request proposer's steps measured slower and lookup chains
        alone have not, else SPEC. The interval is timed in engine-busy seconds (the gaps
        between steps left out)."""
        now, policy = self._busy + time.perf_counter() - step_start, self.policy
        if self._interval is not None:
            start, b, kind, kind_before = self._interval
            decode_only, requests, tokens = self._step
            # a SPEC step after a step of another kind re-warms the proposer: not a sample
            if decode_only and requests == b and (kind != SPEC or kind_before == SPEC):
                policy.realized.observe(b, kind, now - start, tokens, policy.cost.step_time(b, b))
        kind = PLAIN
        if eligible and not policy.cost.plain_due(batch):
            kind = policy.realized.speculate(batch, self._fallback)
        self._interval = (now, batch, kind, self._interval[2] if self._interval is not None else PLAIN)
        return kind

    def _draft(self, eligible, states, batch: int, chains: list[list[int]] | None) -> list[DraftTree | None]:
        """The per-request proposer, for the requests where it pays beside their lookup chains
        (and probes: `drafted` with the gate off). A proposer whose drafts cost no model time
        (suffix decoding) drafts for every request like prompt lookup, and its trees' first
        paths are valued like lookup chains, by each request's own acceptance by depth."""
        free = not self._model_drafts
        chosen = list(range(len(states))) if free else [
            j for j, s in enumerate(states)
            if self.policy.draft_pays(s, batch, self._num_drafted, len(chains[j]) if chains else 0)]
        trees: list[DraftTree | None] = [None] * len(eligible)
        ks = [min(self.max_drafts, room) for _, room in eligible]
        if self.proposer.name == "draft_model":  # its KV goes to the slots of the next verify step
            chosen = [j for j in chosen if self.kv.try_allocate(eligible[j][0], 1 + ks[j])]
        self._num_drafted = max(1, len(chosen))
        reqs = [eligible[j][0] for j in chosen]
        # a call is steady when the proposer drafted for each of its requests in the step before:
        # what drafting costs a step while it goes on (draft_pays' question), without a first
        # call's pass over a prompt or a probe's catch-up over the tokens since the last one
        steady, self._drafted_last = (self._drafted_last.issuperset(r.request_id for r in reqs),
                                      {r.request_id for r in reqs})
        if not chosen:
            return trees
        batch_in = ProposeBatch(
            [r.request_id for r in reqs], [r.all_token_ids for r in reqs],
            [ks[j] for j in chosen], self.policy.min_score(batch),
            [r.params for r in reqs], [r.sampling_seed for r in reqs], [r.block_ids for r in reqs],
            [r.num_computed_tokens for r in reqs], [r.tenant for r in reqs])
        start = device_clock(self.runner.device)  # (on CUDA: the drafts' work, not their launches)
        drafted = self.proposer.propose(batch_in)
        if self.policy.adaptive and steady:
            self.policy.draft_cost.update(len(chosen), device_clock(self.runner.device) - start)
        for j, tree in zip(chosen, drafted):
            trees[j] = tree
            if free and tree is not None:  # the first path is valued (and learnt) as lookup
                states[j].chain_nodes = path = tree.first_path()
                if tree.scores is not None:
                    tree.scores = [None] * len(path) + tree.scores[len(path):]
            elif free:
                states[j].chain_nodes = []
            else:
                states[j].drafted = True
        return trees

    def _select(self, eligible, states, trees, batch: int) -> None:
        cands, values, probe, where, idle_ahead = [], [], [], [], math.inf
        for (req, room), state, tree in zip(eligible, states, trees):
            if tree is not None and state.grammar is not None:
                tree, state.masks, state.chain_nodes = cut(tree, state.grammar, state.chain_nodes)
            if tree is None or not len(tree):
                state.tree, state.chain_nodes, state.masks = None, [], None
                idle_ahead = min(idle_ahead, state.ahead)
                continue
            state.unverified += 1
            cands.append(tree)
            values.append(self.policy.values(state, tree) if self.policy.adaptive else None)
            probe.append((state.drafted and not state.gate.on) or state.unverified >= state.probe_every)
            where.append((req, room, state))
        # requests without drafts: those eligible but idle, and prefills (at most a fraction
        # of one step later to their first token), whose lead counts as none
        if len(eligible) < batch:
            idle_ahead = 0.0
        keep = self.policy.select(batch, cands, values, probe, self.max_rows,
                                  [s.ahead for _, _, s in where], 0.0 if idle_ahead == math.inf else idle_ahead)
        if self.policy.adaptive:
            rows = sum(min(len(nodes), room) for (_, room, _), nodes in zip(where, keep))
            self._slowdown = self.policy.slowdown(batch, batch + rows)
        for (req, room, state), tree, nodes in zip(where, cands, keep):
            # depth first, first choices first (parents first: a prefix is still a tree); the
            # kept nodes of a depth-first tree already are, taken in index order
            nodes = sorted(nodes[:room]) if tree.dfs else preorder(tree.parents, nodes[:room])
            if not nodes:
                state.tree, state.chain_nodes = None, []
                state.masks = state.masks[:1] if state.masks is not None else None  # the root's
                continue
            if nodes != list(range(len(tree))):  # else the whole tree as it is
                index = {old: new for new, old in enumerate(nodes)}
                state.chain_nodes = [index[n] for n in state.chain_nodes if n in index]
                tree = tree.prefix(len(nodes)) if nodes[-1] == len(nodes) - 1 else tree.select(nodes, True)
            state.tree = tree
            if state.masks is not None:
                state.masks = state.masks[[0] + [n + 1 for n in nodes]]
            req.spec_token_ids = list(state.tree.tokens)
