"""The one tree-mask convention (specserve/model/tree_mask.py): positions, masks, packed words."""

import numpy as np
import pytest

from specserve.model import tree_mask as tm

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def _ancestors_by_walking(parents):
    """Independent of the one-pass construction: walk up from every node."""
    anc = np.zeros((len(parents), len(parents)), dtype=bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc


def _random_parents(n, rng, roots=False):
    return [-1] + [int(rng.integers(-1 if roots else 0, i)) for i in range(1, n)]


def test_depths_and_root_paths():
    assert tm.depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tm.root_paths(PARENTS) == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    assert tm.depths([-1, -1, 1]).tolist() == [0, 0, 1]  # a forest: every root hangs off the prefix


def test_positions_move_tree_rows_to_prefix_plus_depth():
    # a decode at 10, the tree above after a prefix of 20, a chain of 3 at 7, a 2-node forest at 4
    positions = [10] + list(range(20, 27)) + [7, 8, 9] + [4, 5]
    out = tm.tree_positions(positions, [1, 7, 3, 2], [None, PARENTS, None, [-1, -1]])
    assert out == [10] + [20, 21, 21, 22, 22, 22, 23] + [7, 8, 9] + [4, 4]
    chain = tm.tree_positions(list(range(5, 9)), [4], [tm.chain_parents(4)])
    assert chain == [5, 6, 7, 8]  # a chain is the causal case
    with pytest.raises(ValueError):
        tm.tree_positions(positions, [1, 7, 3, 2], [None, PARENTS[:-1], None, None])


def test_ancestor_matrix():
    rng = np.random.default_rng(0)
    for n, roots in [(1, False), (7, False), (40, False), (40, True)]:
        parents = _random_parents(n, rng, roots)
        assert np.array_equal(tm.ancestor_matrix(parents), _ancestors_by_walking(parents))
    assert np.array_equal(tm.ancestor_matrix(PARENTS), _ancestors_by_walking(PARENTS))
    assert np.array_equal(tm.ancestor_matrix(tm.chain_parents(5)), np.tril(np.ones((5, 5), dtype=bool)))
    for bad in ([-1, 1], [-1, 2, 0], [-2]):  # a child before (or as) its parent; a bad root
        with pytest.raises(ValueError):
            tm.ancestor_matrix(bad)


def test_packed_words_round_trip():
    rng = np.random.default_rng(1)
    for m in (1, 31, 32, 33, 70):
        dense = rng.random((9, m)) < 0.5
        packed = tm.pack_bits(dense)
        assert packed.dtype == np.int32 and packed.shape == (9, tm.num_words(m))
        assert np.array_equal(tm.unpack_bits(packed, m), dense)
        assert np.array_equal(tm.unpack_bits(tm.pack_bits(dense, 4), m), dense)
    # bit j % 32 of word j // 32, two's complement: bit 31 makes a word negative
    assert tm.pack_bits(tm.ancestor_matrix([-1, 0, 0, 1, 2, -1])).ravel().tolist() == [1, 3, 5, 11, 21, 32]
    causal = tm.pack_bits(tm.ancestor_matrix(tm.chain_parents(33)))
    assert causal[31].tolist() == [-1, 0] and causal[32].tolist() == [-1, 1]
    with pytest.raises(ValueError):
        tm.pack_bits(np.ones((2, 40), dtype=bool), 1)


def test_packed_step_mask_is_causal_outside_trees():
    packed = tm.packed_step_mask([None, PARENTS, None], [3, 7, 1])
    assert packed.shape == (11, 1)
    rows = tm.unpack_bits(packed, 7)
    assert np.array_equal(rows[:3, :3], np.tril(np.ones((3, 3), dtype=bool))) and not rows[:3, 3:].any()
    assert np.array_equal(rows[3:10], tm.ancestor_matrix(PARENTS))
    assert rows[10].tolist() == [True] + [False] * 6
    assert tm.packed_step_mask([tm.chain_parents(40), None], [40, 1]).shape == (41, 2)  # words for the longest
