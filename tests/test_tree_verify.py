"""Tree verification (specserve.spec_decode.tree): greedy against a brute force, sampled against the
target distribution (chi-square on a small vocabulary, with a broken rule as negative
control), and the KV compaction slots."""

import random

import pytest
import torch
from scipy.stats import chisquare

from specserve.kernels import compact_kv
from specserve.spec_decode.draft_tree import DraftTree
from specserve.spec_decode.tree import compaction_slots, verify_tree

V = 8


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    """Random shape; sibling tokens distinct (so the greedy path is unique)."""
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


def brute_force_greedy(logits: torch.Tensor, tree: DraftTree) -> tuple[list[int], list[int]]:
    best = logits.argmax(-1).tolist()
    found = []  # (depth, path) of every node whose whole path matches the target argmax
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
    end = path[-1] + 1 if path else 0
    return path, [tree.tokens[c] for c in path] + [best[end]]


def test_greedy_matches_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        tree = random_tree(rng, rng.randrange(0, 14), 4)
        logits = torch.randn(len(tree) + 1, 4, generator=torch.Generator().manual_seed(trial))
        # plant a matching path now and then so deep acceptances are exercised
        if trial % 2 and len(tree):
            node = rng.randrange(len(tree))
            while node >= 0:
                parent = tree.parents[node]
                logits[parent + 1, tree.tokens[node]] += 10.0
                node = parent
        verdict = verify_tree(logits, tree, greedy=True)
        assert (verdict.path, verdict.tokens) == brute_force_greedy(logits, tree)


def _dist(prefix: tuple, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((salt,) + prefix) % (1 << 31))
    return torch.softmax(torch.randn(V, generator=g) * 1.5, -1)


def _two_token_counts(rule: str, trials: int, iid: bool) -> torch.Tensor:
    """Counts of the first two emitted tokens when a width-3/2 tree is verified each trial
    (a step that emits one token is completed by plain sampling, as the next step would)."""
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        q_root = _dist((), 1)
        if iid:  # SpecInfer: siblings are independent draws from the parent's q
            kids = torch.multinomial(q_root, 3, replacement=True, generator=gen).tolist()
        else:  # fixed top-k candidates, one-hot q
            kids = q_root.topk(3).indices.tolist()
        tokens, parents, probs = list(kids), [-1, -1, -1], [q_root] * 3
        for i, x in enumerate(kids):
            q = _dist((x,), 1)
            gk = (torch.multinomial(q, 2, replacement=True, generator=gen).tolist() if iid
                  else q.topk(2).indices.tolist())
            tokens += gk
            parents += [i, i]
            probs += [q, q]
        tree = DraftTree(tokens, parents, torch.stack(probs) if iid else None)
        prefixes = [()] + [(tokens[i],) if parents[i] < 0 else (tokens[parents[i]], tokens[i])
                           for i in range(len(tokens))]
        target = torch.stack([_dist(p, 2) for p in prefixes])
        out = verify_tree(target, tree, greedy=False, generator=gen, rule=rule).tokens
        if len(out) < 2:
            out.append(int(torch.multinomial(_dist((out[0],), 2), 1, generator=gen)))
        counts[out[0], out[1]] += 1
    return counts


def _expected(trials: int) -> torch.Tensor:
    p1 = _dist((), 2)
    return torch.stack([p1[a] * _dist((a,), 2) for a in range(V)]) * trials


@pytest.mark.parametrize("iid", [True, False])
def test_tree_sampling_reproduces_target(iid):
    trials = 6000
    counts = _two_token_counts("exact", trials, iid)
    exp = _expected(trials)
    keep = exp > 5  # chi-square needs enough expected counts per cell
    obs, e = counts[keep], exp[keep]
    e = e * obs.sum() / e.sum()
    assert chisquare(obs.numpy(), e.numpy()).pvalue > 1e-3


def test_broken_rule_fails_the_same_test():
    trials = 6000
    counts = _two_token_counts("naive_resample", trials, True)
    exp = _expected(trials)
    keep = exp > 5
    obs, e = counts[keep], exp[keep]
    e = e * obs.sum() / e.sum()
    assert chisquare(obs.numpy(), e.numpy()).pvalue < 1e-6


def test_compaction_moves_the_accepted_path():
    # tree of 6 drafts at root position 13 over blocks [5, 2, 7] of 8 slots: path nodes 1 -> 3 -> 5
    block_ids, bs, start, path = [5, 2, 7], 8, 13, [1, 3, 5]
    src, dst = compaction_slots(block_ids, bs, start, path)

    def slot(pos):
        return block_ids[pos // bs] * bs + pos % bs

    assert src.tolist() == [slot(start + 2), slot(start + 4), slot(start + 6)]
    assert dst.tolist() == [slot(start + 1), slot(start + 2), slot(start + 3)]
    cache = torch.arange(8 * bs, dtype=torch.float32).view(8, bs, 1, 1).repeat(1, 1, 1, 2)
    v = cache.clone()
    compact_kv(cache, v, src, dst)
    flat = cache.view(-1, 2)[:, 0]
    assert [int(flat[slot(start + j)]) for j in range(4)] == [slot(start), *src.tolist()]
    assert compaction_slots(block_ids, bs, start, [0, 1])[0].numel() == 0  # chain: nothing moves
