"""TreeSpecDecoder: the engine's SpecDecoder for tree methods (eagle, medusa).

The engine loop stays as it is (schedule -> execute -> sample_and_verify -> update -> propose);
this class supplies the three speculative hooks for draft trees:
  * `tree_parents(sched)`: each request's tree (its last committed token as root, then the
    nodes the scheduler kept: a tree cut to its first k nodes is still a tree), None for a
    chain (causal attention gives the same rows);
  * `sample_and_verify(sched, step)`: every row of every request is processed with the
    request's own sampling parameters (penalties see the node's ancestors), each tree is
    verified with specserve.spec_decode.tree.verify_tree, the accepted path's KV is compacted into
    place (the engine's truncate then rolls back the rest), and the proposer is shown the
    target features of every newly computed committed token (prefill chunks included, from
    StepLogits.all_hidden);
  * `propose(running)`: one DraftTree per request that may speculate. With "lookup_branch": L
    (default LOOKUP_BRANCH), an n-gram prompt-lookup chain of up to L tokens is grafted onto
    each tree (shared prefixes merge), so text that repeats the context (summaries, RAG
    answers, edits) is drafted as well as the head drafts fresh text; a request whose head
    the TreeGate has paused still gets the lookup chain alone, which costs no head pass.
    With "adaptive" (the default) each request's chain length follows its own acceptance:
    it doubles (up to 4 L) when the whole chain was accepted and halves (down to L / 2) when
    its first token was rejected, so copied text gets long chains and fresh text short ones.
Noise is a pure function of (request seed, position, column), as in the plain sampler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specserve.config import SpecConfig
from specserve.model.runner import StepLogits
from specserve.request import Request
from specserve.sampler import (
    SamplingBatch,
    apply_penalties,
    gather_logprobs,
    processed_probs,
    uniform_noise,
)
from specserve.scheduler.scheduler import SchedulerOutput
from specserve.spec_decode.adaptive import TreeGate
from specserve.spec_decode.draft_tree import DraftTree
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.quant import check_quantization
from specserve.spec_decode.step import SpecDecoder, StepResult
from specserve.spec_decode.tree import children_lists, compaction_slots, verify_tree


def make_tree_proposer(config: SpecConfig, engine):
    model = engine.runner.model
    m = config.num_speculative_tokens
    device = model.lm_head.weight.device
    quantize = check_quantization(config.extra.get("quantization"), device)
    if config.method == "eagle":
        from specserve.config import DEFAULT_MODEL
        from specserve.model.loader import canonical_alias
        from specserve.spec_decode.eagle import EagleProposer

        if config.model is None and canonical_alias(engine.config.model.model) != DEFAULT_MODEL:
            raise ValueError("speculative_config.model: the shipped EAGLE head is for the default "
                             "model; name a head trained for this target")
        return EagleProposer(model, config.model, m, config.depth, config.topk, max_positions=engine.max_model_len + 64,
                             min_prob=config.extra.get("min_draft_prob", MIN_DRAFT_PROB.get(device.type, 0.0)),
                             quantize=quantize)
    if config.method == "medusa":
        from specserve.spec_decode.medusa import MedusaProposer

        if config.model is None:
            raise ValueError("speculative_config.model: method 'medusa' needs a heads directory")
        return MedusaProposer(model, config.model, m, config.extra.get("medusa_tree"), quantize=quantize)
    raise ValueError(f"speculative_config.method: {config.method!r} is not a tree method")


LOOKUP_BRANCH = 4  # default n-gram chain length grafted onto each tree (0: off)
# eagle: tree nodes whose cumulative draft probability is below this are cut, by device type
# (others: 0). CPU: 0.15 measured best on Spec-Bench (0 / 0.05 / 0.15: 1.41x / 1.61x / 1.70x in one run,
# 0.15 / 0.25 / 0.4: 1.68x / 1.66x / 1.61x in another; docs/eagle.md); on a GPU extra rows and
# head passes cost next to nothing
MIN_DRAFT_PROB = {"cpu": 0.15, "cuda": 0.0}


@dataclass
class _Track:
    """What the decoder keeps for one request between its steps."""
    tree: DraftTree | None = None  # the last tree proposed (the scheduler may keep a prefix)
    branch: int = 0  # lookup chain length (adaptive)
    chain_nodes: list[int] = field(default_factory=list)  # tree nodes of this step's grafted chain


class TreeSpecDecoder(SpecDecoder):
    def __init__(self, config: SpecConfig, engine, proposer=None) -> None:
        super().__init__(config, engine)
        self.proposer = proposer or make_tree_proposer(config, engine)
        self.max_drafts = config.num_speculative_tokens
        self.lookup = config.extra.get("lookup_branch", LOOKUP_BRANCH)
        self.ngram = (NgramProposer(self.lookup, config.prompt_lookup_min, config.prompt_lookup_max)
                      if self.lookup else None)
        self._head_ran: set[str] = set()  # requests the head drafted for this step (a tree or none)
        self._tracks: dict[str, _Track] = {}  # requests the proposer holds state for
        self.adaptive = config.extra.get("adaptive", True)
        self.gate = TreeGate(self.adaptive)
        self._propose_end = 0.0
        self._propose_s = 0.0

    def _track(self, rid: str) -> _Track:
        if rid not in self._tracks:
            self._tracks[rid] = _Track(branch=self.lookup)
        return self._tracks[rid]

    def _tree(self, req: Request, k: int) -> DraftTree:
        t = self._tracks[req.request_id].tree
        return DraftTree(t.tokens[:k], t.parents[:k])

    def tree_parents(self, sched: SchedulerOutput) -> list[list[int] | None] | None:
        """Each request's verify rows as a tree (the last committed token, then the drafts), or
        None where they form a chain: plain causal attention then gives the same rows, without
        the tree path's permutations."""
        out = []
        for r, k in zip(sched.requests, sched.num_drafts):
            tree = self._tree(r, k) if k else None
            out.append(None if tree is None or tree.is_chain else [-1] + [p + 1 for p in tree.parents])
        return out if any(p is not None for p in out) else None

    # -- verification -----------------------------------------------------------------------
    def sample_and_verify(self, sched: SchedulerOutput, step: StepLogits) -> list[StepResult]:
        if self._propose_end and sched.decode_only:
            # a decode-only step: its cost is the target forward plus the drafting before it
            trees = bool(self._head_ran)  # lookup chains alone cost no head pass: plain
            seconds = time.perf_counter() - self._propose_end + (self._propose_s if trees else 0.0)
            self.gate.observe_step(seconds, len(sched), trees)
        results: list[StepResult] = []
        off = 0
        for req, n, k, row in zip(sched.requests, sched.num_tokens, sched.num_drafts, step.row_start):
            start = req.num_computed_tokens
            if row < 0:  # mid-prefill chunk: every token is committed
                self.proposer.observe(req, start, step.all_hidden[off:off + n])
                self._track(req.request_id)
                results.append(None)
            else:
                results.append(self._verify_one(req, start, k, step.logits[row:row + k + 1],
                                                step.all_hidden[off:off + n], n - k - 1))
            off += n
        return results

    def _verify_one(self, req: Request, start: int, k: int, logits: torch.Tensor,
                    hidden: torch.Tensor, num_before: int) -> StepResult:
        """logits: [k + 1, V] rows of the root and the k nodes; hidden: [num_before + k + 1,
        hidden], every token of this step; num_before: tokens before the root (the rest of a
        prompt chunk), all committed."""
        tree = self._tree(req, k) if k else DraftTree([], [])
        ancestors: list[list[int]] = [[]]
        for p, tok in zip(tree.parents, tree.tokens):
            ancestors.append(ancestors[p + 1] + [tok])
        batch = SamplingBatch.build([(req, a) for a in ancestors], self.vocab_size, logits.device)
        greedy = req.params.greedy
        target = apply_penalties(logits, batch) if greedy else processed_probs(logits, batch)
        uniforms = noise = None
        if not greedy:
            kids = children_lists(tree.parents)
            width = max(len(c) for c in kids)
            u = uniform_noise(batch.seeds, batch.positions, self.vocab_size + width)
            noise = -torch.log(u[:, :self.vocab_size]).float()
            child_u = u[:, self.vocab_size:].tolist()  # one transfer, not one per node
            flat = [0.0] * max(k, 1)
            for r, cs in enumerate(kids):
                for j, c in enumerate(cs):
                    flat[c] = child_u[r][j]
            uniforms = torch.tensor(flat)
        verdict = verify_tree(target, tree, greedy, uniforms, noise)
        if verdict.path != list(range(len(verdict.path))):  # accepted nodes are not a prefix
            src, dst = compaction_slots(req.block_ids, self.engine.kv.block_size,
                                        start + num_before, verdict.path)
            src, dst = src.to(logits.device), dst.to(logits.device)
            from specserve.kernels import compact_kv

            for k_cache, v_cache in self.engine.runner.kv_caches:
                compact_kv(k_cache, v_cache, src, dst)
        self._adapt_branch(self._track(req.request_id), k, verdict.path)
        rows = [0] + [c + 1 for c in verdict.path]
        # features of the committed tokens computed this step: prompt rest, root, accepted path
        self.proposer.observe(req, start, hidden[list(range(num_before)) + [num_before + r for r in rows]])
        self._count(req, k, len(verdict.path))
        if req.request_id in self._head_ran:  # a head that found no likely node scores 1 token
            self.gate.observe(req, len(verdict.path) + 1)
        tokens = verdict.tokens
        if req.params.logprobs is None:
            return tokens, None
        ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        return tokens, gather_logprobs(logits[rows], ids, [req.params.logprobs] * len(tokens))

    def _adapt_branch(self, track: _Track, k: int, path: list[int]) -> None:
        """Lookup chain length: double when the whole chain (as scheduled) was accepted, halve
        when its first token was rejected."""
        nodes = [i for i in track.chain_nodes if i < k]
        track.chain_nodes = []
        if not nodes or not self.adaptive:
            return
        length, accepted = track.branch, set(path)
        if nodes[0] not in accepted:
            track.branch = max(1, self.lookup // 2, length // 2)
        elif all(i in accepted for i in nodes) and len(nodes) >= length:
            track.branch = min(4 * self.lookup, 2 * length)

    def _count(self, req: Request, k: int, accepted: int) -> None:
        stats = self.engine._stats
        while len(stats.spec_accepted_per_pos) < accepted:
            stats.spec_accepted_per_pos.append(0)
        super()._count(req, k, accepted)

    # -- drafting ---------------------------------------------------------------------------
    def propose(self, running: list[Request]) -> None:
        start = time.perf_counter()
        live = self.engine.requests
        for rid in [r for r in self._tracks if r not in live]:  # finished or aborted
            del self._tracks[rid]
            self.proposer.free(rid)
        head, lookup_only = [], []  # (request, room for drafts)
        max_len = self.engine.max_model_len
        for req in running:
            if req.num_output_tokens == 0 or req.num_computed_tokens != req.num_tokens - 1:
                continue
            room = min(req.max_tokens - req.num_output_tokens, max_len - req.num_tokens) - 1
            if room < 1:
                continue
            if self.gate.active(req):
                head.append((req, room))
            elif self.ngram is not None:
                lookup_only.append((req, room))
        reqs = [r for r, _ in head]
        trees = list(self.proposer.propose(reqs, [min(self.max_drafts, n) for _, n in head])) if head else []
        self._head_ran = {r.request_id for r in reqs}
        if self.ngram is not None:
            both = head + lookup_only
            reqs, trees = [r for r, _ in both], trees + [None] * len(lookup_only)
            tracks = [self._track(r.request_id) for r in reqs]
            chains = self.ngram.propose(reqs, [min(t.branch, n) for t, (_, n) in zip(tracks, both)])
            for i, ((req, room), chain, track) in enumerate(zip(both, chains, tracks)):
                track.chain_nodes = []
                if chain is not None and (trees[i] is None or trees[i].probs is None):
                    trees[i], track.chain_nodes = (trees[i] or DraftTree([], [])).graft(chain.tokens, room)
        for req, tree in zip(reqs, trees):
            if tree is None or not len(tree):
                continue
            self._track(req.request_id).tree = tree
            req.spec_token_ids = list(tree.tokens)
            req.spec_draft_probs = None
        self._propose_end = time.perf_counter()
        self._propose_s = self._propose_end - start
        self._maybe_log()
