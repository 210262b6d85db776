"""Batched tree verification (specserve.sampling.rejection): greedy against a brute force over
many requests in one call, sampled against the target distribution (chi-square on a small
vocabulary, one-hot trees and draft-model chains, with a broken rule as negative control)."""

import random

import pytest
import torch
from scipy.stats import chisquare

import specserve.sampling.rejection as rejection
from specserve.sampling import FlatTrees, verify_trees
from specserve.spec_decode.draft_tree import DraftTree, preorder

V = 8


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    """Random shape; sibling tokens distinct."""
    parents, tokens, used = [], [], {}
    for i in range(n):
        for _ in range(20):
            p = rng.randrange(-1, i)
            free = [t for t in range(vocab) if t not in used.get(p, set())]
            if free:
                break
        else:
            break
        t = rng.choice(free)
        used.setdefault(p, set()).add(t)
        parents.append(p)
        tokens.append(t)
    return DraftTree(tokens, parents)


def brute_force_greedy(logits: torch.Tensor, tree: DraftTree) -> tuple[list[int], int]:
    best = logits.argmax(-1).tolist()
    found = []  # every node whose whole path matches the target argmax
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = tree.parents[j]
        path.reverse()
        rows = [0] + [c + 1 for c in path[:-1]]
        if all(tree.tokens[c] == best[r] for c, r in zip(path, rows)):
            found.append(path)
    path = max(found, key=len) if found else []
    return path, best[path[-1] + 1 if path else 0]


def verify(target, trees, greedy, seeds, coupled=False):
    """Lay the requests' rows out one after another, as the runner does, and verify them all
    (coupled: sampled requests are seeded ones, verified against plain sampling's draws)."""
    roots, at = [], 0
    for t in trees:
        roots.append(at)
        at += 1 + len(t)
    assert target.shape[0] == at
    flat = FlatTrees(roots, [(t.tokens, t.parents, t.probs) for t in trees], target.shape[1], "cpu")
    depth = [d for t in trees for d in [0] + t.depth]
    pos = torch.tensor(depth) + 100
    exact = [g or coupled for g in greedy]
    rows = [r for b, t in enumerate(trees) for r in range(roots[b], roots[b] + 1 + len(t)) if not greedy[b]]
    row_seeds = [seeds[b] for b, t in enumerate(trees) for _ in range(1 + len(t)) if not greedy[b]]
    pairs = (torch.tensor(rows), torch.tensor(row_seeds)) if coupled and rows else None
    return verify_trees(target, torch.tensor(exact), torch.tensor(seeds), pos, flat, all(exact), pairs)


def test_preorder_lists_the_first_choice_path_first():
    # value order (as the policy keeps nodes): 0 and 1 children of the root, 2 under 0, 3 under 1, 4 under 2
    parents = [-1, -1, 0, 1, 2]
    assert preorder(parents, [0, 1, 2, 3, 4]) == [0, 2, 4, 1, 3]
    assert preorder(parents, [1, 0, 3, 2]) == [1, 3, 0, 2]  # siblings keep their order in the list
    assert preorder([-1, 0, 1], [0, 1, 2]) == [0, 1, 2]  # a chain as it was
    rng = random.Random(3)
    for _ in range(50):
        tree = random_tree(rng, rng.randrange(1, 12), V)
        order = preorder(tree.parents, list(range(len(tree))))
        assert sorted(order) == list(range(len(tree)))
        assert all(tree.parents[i] < 0 or order.index(tree.parents[i]) < order.index(i) for i in order)
        first = [order[0]]  # depth first: the leading run of parent -> child ends at a leaf
        for i in order[1:]:
            if tree.parents[i] != first[-1]:
                break
            first.append(i)
        assert tree.parents[first[0]] == -1 and first[-1] not in tree.parents


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float32 on x86: the C walk
def test_greedy_matches_brute_force_for_a_whole_batch(dtype):
    rng = random.Random(0)
    trees, logits = [], []
    for trial in range(200):
        tree = random_tree(rng, rng.randrange(0, 14), 4)
        x = torch.randn(len(tree) + 1, 4, generator=torch.Generator().manual_seed(trial))
        if trial % 2 and len(tree):  # plant a matching path now and then: deep acceptances
            node = rng.randrange(len(tree))
            while node >= 0:
                parent = tree.parents[node]
                x[parent + 1, tree.tokens[node]] += 10.0
                node = parent
        if trial % 5 == 0:  # ties: the first of the largest is the argmax
            x = x.round()
        trees.append(tree)
        logits.append(x.to(dtype))
    verdict = verify(torch.cat(logits), trees, [True] * len(trees), list(range(len(trees))))
    for tree, x, path, final in zip(trees, logits, verdict.accepted, verdict.final):
        assert (path, final) == brute_force_greedy(x, tree)


def _dist(prefix: tuple, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((salt,) + prefix) % (1 << 31))
    return torch.softmax(torch.randn(V, generator=g) * 1.5, -1)


def _case(kind: str):
    """One request's draft and its target rows; the first two emitted tokens are compared with
    the target's two-token distribution. kind: a width-3/2 tree of one-hot top-k candidates, a
    chain drawn from q (a draft model), or no drafts at all (plain sampling)."""
    if kind == "tree":
        kids = _dist((), 1).topk(3).indices.tolist()
        tokens, parents = list(kids), [-1, -1, -1]
        for i, x in enumerate(kids):
            tokens += _dist((x,), 1).topk(2).indices.tolist()
            parents += [i, i]
        tree = DraftTree(tokens, parents)
    elif kind == "none":
        tree = DraftTree([], [])
    else:
        tree = None
    if tree is not None:
        prefixes = [()] + [(tree.tokens[i],) if p < 0 else (tree.tokens[p], tree.tokens[i])
                           for i, p in enumerate(tree.parents)]
        return tree, torch.stack([_dist(p, 2) for p in prefixes])
    return None, None


def _two_token_counts(kind: str, trials: int, coupled: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    trees, targets = [], []
    for _ in range(trials):
        tree, target = _case(kind)
        if kind == "chain":  # two drafts sampled from the draft's own distributions
            q1 = _dist((), 1)
            x1 = int(torch.multinomial(q1, 1, generator=gen))
            q2 = _dist((x1,), 1)
            x2 = int(torch.multinomial(q2, 1, generator=gen))
            tree = DraftTree.chain([x1, x2], torch.stack([q1, q2]))
            target = torch.stack([_dist((), 2), _dist((x1,), 2), _dist((x1, x2), 2)])
        trees.append(tree)
        targets.append(target)
    verdict = verify(torch.cat(targets), trees, [False] * trials, list(range(trials)), coupled)
    counts = torch.zeros(V, V)
    for tree, path, final in zip(trees, verdict.accepted, verdict.final):
        out = [tree.tokens[n] for n in path] + [final]
        if len(out) < 2:  # a step that emits one token is completed by plain sampling
            out.append(int(torch.multinomial(_dist((out[0],), 2), 1, generator=gen)))
        counts[out[0], out[1]] += 1
    return counts


def _pvalue(counts: torch.Tensor, trials: int) -> float:
    p1 = _dist((), 2)
    exp = torch.stack([p1[a] * _dist((a,), 2) for a in range(V)]) * trials
    keep = exp > 5  # chi-square needs enough expected counts per cell
    obs, e = counts[keep], exp[keep]
    return chisquare(obs.numpy(), (e * obs.sum() / e.sum()).numpy()).pvalue


@pytest.mark.parametrize("coupled", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("kind", ["tree", "chain", "none"])
def test_sampling_reproduces_the_target(kind, coupled):
    trials = 6000
    assert _pvalue(_two_token_counts(kind, trials, coupled), trials) > 1e-3


def test_seeded_requests_emit_plain_samplings_tokens_whatever_was_drafted():
    """A coupled request's token at each row is plain sampling's draw there: different trees
    (or none) never change the first token, and an accepted path follows the draws."""
    from specserve.sampling.rejection import coupled_tokens

    rng = random.Random(5)
    target = torch.softmax(torch.randn(1, V) * 2, -1)
    draw = int(coupled_tokens(target, torch.tensor([42]), torch.tensor([100]))[0])
    for n in range(0, 12, 3):
        tree = random_tree(rng, n, V)
        rows = torch.cat([target, torch.softmax(torch.randn(n, V), -1)])
        verdict = verify(rows, [tree], [False], [42], coupled=True)
        first = tree.tokens[verdict.accepted[0][0]] if verdict.accepted[0] else verdict.final[0]
        assert first == draw


def test_broken_rules_fail_the_same_test(monkeypatch):
    """Accepting every draft emits the draft's distribution: the test must notice, for both
    rules (a coupled rule that ignores the noise is a greedy one)."""
    with monkeypatch.context() as m:
        m.setattr(rejection, "uniform_at", lambda s, p, c: torch.zeros(s.shape))
        assert _pvalue(_two_token_counts("chain", 6000), 6000) < 1e-6
    monkeypatch.setattr(rejection, "coupled_tokens", lambda probs, s, p: probs.argmax(-1))
    assert _pvalue(_two_token_counts("tree", 6000, coupled=True), 6000) < 1e-6


def test_mixed_batch_and_seeded_reproducibility():
    """Greedy and sampled requests, with and without drafts, in one call; a sampled request's
    result depends on its seed and positions only, not on the batch around it."""
    rng = random.Random(3)
    trees = [random_tree(rng, n, V) for n in (0, 5, 3, 0, 7)]
    target = torch.softmax(torch.randn(sum(len(t) + 1 for t in trees), V), -1)
    greedy = [True, False, True, False, False]
    verdict = verify(target, trees, greedy, [11, 12, 13, 14, 15])
    at = 0
    for b, tree in enumerate(trees):
        rows = target[at:at + len(tree) + 1]
        alone = verify(rows, [tree], [greedy[b]], [11 + b])
        assert (alone.accepted[0], alone.final[0]) == (verdict.accepted[b], verdict.final[b])
        if greedy[b]:
            assert (verdict.accepted[b], verdict.final[b]) == brute_force_greedy(rows, tree)
        at += len(tree) + 1
