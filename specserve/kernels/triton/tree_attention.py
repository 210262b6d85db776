"""Tree attention: verify a draft *tree* in one target forward pass.

Scope
-----
The ``q_len`` query tokens of request ``b`` are the nodes of a draft tree whose
K/V already sit in the paged cache at context positions ``prefix_len + i``
(``prefix_len = seq_lens[b] - q_len``).  Node order is index order and a parent
always has a smaller index than its child, so a chain is the causal case.

Mask semantics
--------------
Node ``i`` attends to every prefix position (``< prefix_len``) and to node
``j`` iff bit ``j`` of its mask row is set.  ``tree_mask`` is int32
[T, ceil(max_query_len / 32)], rows aligned with ``q``; bit ``j % 32`` of word
``j // 32`` (two's complement, so bit 31 makes the word negative).  Bits at or
past the request's ``q_len`` must be zero.  This is the convention of
specserve/model/tree_mask.py, which builds every tree mask; the helpers below
are its torch-facing names.

Cache / batch layout and GQA are exactly those of ``paged_attention``; with
``causal_tree_mask`` the result equals ``paged_attention``, bit for bit on the
Triton path.  The Triton kernels are paged_attention.py's compiled with
``TREE_MASK=True``: the mask predicate is the only difference.  A program holds
one kv head's query heads for a block of nodes; split, one program per
(partition, kv head, request) walks all of the request's node blocks, so each
K/V block of the prefix is read once for the whole tree (fused, the node blocks
of a request run as neighbouring programs that share those reads in L2).  The
tree part is read from the packed bitmask; the fixed partitions give every node
row the bits of the same token's decode row (see paged_attention.py).
"""
from typing import Optional

import torch

from specserve.model import tree_mask as trees  # not `tree_mask`: the kernels' argument name

from .paged_attention import launch_paged_attn, per_request_attention

WORD_BITS = trees.WORD_BITS

# Host-side helpers over specserve/model/tree_mask.py: a CUDA input is copied to the host and
# the result back (they build masks for tests and benchmarks, not inside a step).


def num_mask_words(n: int) -> int:
    return trees.num_words(n)


def pack_tree_mask(dense: torch.Tensor, num_words: Optional[int] = None) -> torch.Tensor:
    """bool [n, m] -> int32 [n, W] with bit j%32 of word j//32 = dense[:, j]."""
    packed = trees.pack_bits(dense.cpu().numpy(), num_words)
    return torch.from_numpy(packed).to(dense.device)


def unpack_tree_mask(words: torch.Tensor, m: int) -> torch.Tensor:
    """int32 [n, W] -> bool [n, m] (inverse of pack_tree_mask)."""
    return torch.from_numpy(trees.unpack_bits(words.cpu().numpy(), m)).to(words.device)


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents: long [n] (local indices, -1 = child of the prefix) -> bool [n, n].

    Row i marks i itself and all of its ancestors.
    """
    return torch.from_numpy(trees.ancestor_matrix(parents.tolist())).to(parents.device)


def tree_mask_from_parents(parents: torch.Tensor, num_words: Optional[int] = None) -> torch.Tensor:
    """parents: long [n] -> int32 [n, W]: each node sees itself and its ancestors."""
    packed = trees.pack_bits(trees.ancestor_matrix(parents.tolist()), num_words)
    return torch.from_numpy(packed).to(parents.device)


def causal_tree_mask(n: int, num_words: Optional[int] = None, device=None) -> torch.Tensor:
    """Chain tree (node i's parent is i - 1): the ordinary causal mask, packed."""
    packed = trees.pack_bits(trees.ancestor_matrix(trees.chain_parents(n)), num_words)
    return torch.from_numpy(packed).to(device or "cpu")


def tree_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask,
                          scale, max_query_len: Optional[int] = None) -> torch.Tensor:
    # q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    # block_tables: int32 [B, max_blocks]; seq_lens: int32 [B]; query_start_loc: int32 [B+1];
    # tree_mask: int32 [T, W]
    return launch_paged_attn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                             max_query_len, tree_mask=tree_mask.contiguous())


def tree_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask,
                       scale, max_query_len: Optional[int] = None) -> torch.Tensor:
    # Same signature as tree_attention_triton; unpacks the bitmask per request.
    def tree(s0, s1, seq_len):
        n = s1 - s0
        prefix = torch.ones(n, seq_len - n, dtype=torch.bool, device=q.device)
        nodes = unpack_tree_mask(tree_mask[s0:s1], n).to(q.device)
        return torch.cat([prefix, nodes], dim=1)  # [n, seq_len]

    return per_request_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                 scale, tree)


def dense_mask_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, dense_mask,
                             scale, max_query_len: Optional[int] = None) -> torch.Tensor:
    """Attention with an explicit mask over context positions.

    dense_mask: bool [T, >= max(seq_lens)]; row t (aligned with q) marks which
    context positions 0..seq_len-1 of its request the query may attend to.
    """
    return per_request_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                 scale, lambda s0, s1, seq_len: dense_mask[s0:s1, :seq_len])
