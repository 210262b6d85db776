"""EAGLE's and Medusa's tree growth in C (`tree_ops.c`), one call each between a step's forwards:
Medusa's trees for a batch from its heads' logits (`medusa_tree_builder`), EAGLE's children of
one head pass (`eagle_children`) and the inputs of its next pass (`eagle_next_pass`).

The C is a CPython extension module on the CPU's kernels (specserve/kernels/cpu: layer_ops.c's
top-k, pylists.h), built and loaded by specserve.kernels.cpu.cbuild with that folder on its
include path: each call reads the step's Python lists in place and returns lists, and takes a
tensor's geometry from specserve.kernels.cpu.layer_ops.rows_view. It runs on every device (off a
float32 CPU tensor the drafts' top-k comes from PyTorch, specserve.sampling.draft_top_k, and the
C takes it as given). `available()` says whether it can run here (a C compiler and Python's
headers needed); EAGLE and Medusa need it. tests/tree_reference.py holds its plain-Python
references.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.kernels.cpu import layer_ops
from specserve.kernels.cpu.cbuild import CPU_DIR, Extension

_ext = Extension(Path(__file__).with_name("tree_ops.c"), include=(CPU_DIR,))


def available() -> bool:
    """Whether the calls below can run here: the extension module built and the CPU's kernels,
    whose rows_view their callers read, loaded."""
    return layer_ops.available() and _ext.available()


def why_unavailable() -> str | None:
    """Why available() is False (None when it is True)."""
    return layer_ops.why_unavailable() or _ext.why_unavailable()


def medusa_tree_builder(heads: int, width: int, d2t: torch.Tensor | None, plan: torch.Tensor, dfs: torch.Tensor):
    """A callable (x, budget, min_score, ids=0) that builds Medusa's draft trees from its heads'
    logits in one call (tree_ops.c: medusa_trees; needs available()); the plan is read once,
    here. x: rows_view of [heads * B, n] logits (row k * B + b: head k,
    request b), whose `width` best tokens per head and request (through d2t [n] int64, when
    given) are the candidates (or, with ids, of their top-`width` log q, ids the address of
    their tokens, as eagle_children); plan: [P, 3] int64 rank paths, shorter first, as (head, rank,
    prefix path or -1); dfs: [P] int64 path indices depth first; budget: B ints. -> per
    request (tokens, parents, scores) of its tree, depth first (empty lists: no node)."""
    plan, dfs = plan.contiguous(), dfs.contiguous()
    assert plan.dtype == dfs.dtype == torch.int64 and plan.dim() == 2 and plan.shape[1] == 3
    assert d2t is None or (d2t.dtype == torch.int64 and d2t.is_contiguous() and not d2t.is_cuda)
    p, build = plan.shape[0], _ext.module.medusa_trees
    plan_ptr, dfs_ptr, map_ptr = plan.data_ptr(), dfs.data_ptr(), 0 if d2t is None else d2t.data_ptr()
    n_map = -1 if d2t is None else len(d2t)

    def trees(x: tuple[int, int, int, int], budget: list[int], min_score: float,
              ids: int = 0) -> list[tuple[list, list, list]]:
        ptr, rows, n, row_stride = x
        b = len(budget)
        if rows != heads * b or width > n or (ids and n != width) or (not ids and n_map not in (-1, n)):
            raise ValueError(f"medusa_trees: {rows} rows of {n} for {heads} heads x {b} requests, "
                             f"top-{width}" + (f", a map of {n_map} ids" if n_map >= 0 else ""))
        return build(ptr, heads, b, n, row_stride, width, map_ptr, ids, plan_ptr, dfs_ptr, p, budget,
                     float(min_score), torch.get_num_threads())

    trees.inputs = (plan, dfs, d2t)  # alive as long as the callable: the kernel reads their memory
    return trees


def eagle_children(x: tuple[int, int, int, int], k: int, d2t: int, min_score: float, grow: list,
                   parents: list[list[int]], ids: int = 0) -> None:
    """EAGLE's children of one head pass in one call (tree_ops.c; needs available()). x:
    rows_view of the pass's draft logits, one row per parent, request after request (or, with
    ids, of their top-k log q, ids the address of the [rows, k] int64 tokens: see
    specserve.sampling.draft_top_k); grow: the growing trees (objects with lists tokens,
    scores, parents, out_row, rows); parents: each one's parent nodes (-1: its root). Each
    parent gets its k best tokens (through d2t, the address of an [n] int64 map, or 0) scoring
    the parent's score + log q; each tree's `frontier` becomes its k best new nodes (ties: the
    earlier) scoring at least min_score."""
    if not 1 <= k <= x[2] or (ids and k != x[2]):
        raise ValueError(f"eagle_children: k={k} of {x[2]} columns")
    _ext.module.eagle_children(*x, k, d2t, ids, torch.get_num_threads(), float(min_score), grow, parents)


def eagle_next_pass(grow: list, depth: int, device: torch.device | None = None, host_masks: bool = False):
    """The inputs of EAGLE's next head pass in one call (tree_ops.c; needs available()),
    with the growing trees' bookkeeping updated. -> (the index in grow of each tree in the pass,
    token ids [N], positions [N], each row's parent's row in the last pass's output [N], per
    tree (mask [f, past + f] bool, past, f)), the tensors on `device` (None: the CPU; the masks
    stay on the CPU with host_masks), or None when no tree has a frontier; off the CPU all of it
    goes over in one copy."""
    got = _ext.module.eagle_next_pass(grow, depth)
    if got is None:
        return None
    active, index, segments = got
    if device is None or host_masks:
        index = torch.frombuffer(index, dtype=torch.int64)
        index = index if device is None else index.to(device, non_blocking=True)
        masks = [torch.frombuffer(m, dtype=torch.bool) for m, _, _ in segments]
    else:  # index first (8-byte aligned), then every mask
        flat = torch.frombuffer(bytearray().join([index, *(m for m, _, _ in segments)]), dtype=torch.uint8)
        flat, size = flat.to(device), len(index)
        index = flat[:size].view(torch.int64)
        masks = flat[size:].view(torch.bool).split([len(m) for m, _, _ in segments])
    return active, *index.view(3, -1).unbind(), [(m.view(f, -1), past, f)
                                                  for m, (_, past, f) in zip(masks, segments)]
