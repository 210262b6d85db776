"""Lossless speculative-decoding rejection sampling (one Triton program per request).

Rule (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", ICML 2023; Chen et al., "Accelerating Large Language Model Decoding
with Speculative Sampling", 2023).  For request ``b`` with ``n = num_draft[b]``
draft tokens ``x_0..x_{n-1}``, walk positions ``i = 0..n-1`` in order:

* greedy row: ``x_i`` is *accepted* iff ``x_i == argmax target[b, i]``.
* sampled row: ``x_i`` is *accepted* iff ``u_i * q_i(x_i) < p_i(x_i)``, i.e.
  ``u_i < min(1, p_i(x_i) / q_i(x_i))`` with ``p = target_probs[b, i]`` and
  ``q = draft_probs[b, i]`` (``q`` one-hot at ``x_i`` when ``draft_probs`` is None).

At the first rejected position a *recovered* token is emitted and the walk
stops: greedy ``argmax p_i``; sampled a draw from ``norm(max(0, p_i - q_i))``,
realised as ``argmax(max(0, p_i - q_i) / exp_noise[b, i])`` (exponential-race /
Gumbel-max trick; if the residual is identically zero we draw from ``p_i``).
If all ``n`` drafts are accepted a *bonus* token is drawn from
``target_probs[b, n]`` (greedy: argmax; sampled: ``argmax(p / exp_noise[b, n])``).
Output row: accepted drafts, then the recovered/bonus token, then -1 padding;
``num_emitted = accepted + 1``.  The emitted sequence is distributed exactly
as sampling from the target model.

Shapes: draft_token_ids int64 [B, K]; num_draft int64 [B]; draft_probs float
[B, K, V] or None; target_probs float [B, K+1, V]; is_greedy bool [B];
uniforms float [B, K]; exp_noise float [B, K+1, V].  Returns
(output_token_ids int64 [B, K+1], num_emitted int64 [B]).  Ties in argmax go
to the lowest index in both implementations.
"""
from typing import Optional, Tuple

import torch

from ._triton import HAS_TRITON, tl, triton  # noqa: F401 (HAS_TRITON re-exported)
from ._triton import next_pow2 as _next_pow2


@triton.jit
def _argmax_row(row_ptr, V, BLOCK_V: tl.constexpr):
    # Reads V elements of one row (target probs or logits): first index of the max.
    best_val = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        idx = tl.argmax(x, 0) + start
        upd = m > best_val
        best_idx = tl.where(upd, idx, best_idx)
        best_val = tl.where(upd, m, best_val)
    return best_idx


@triton.jit
def _sample_residual(p_ptr, q_ptr, noise_ptr, excl_tok, V, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    # argmax_v max(0, p - q)[v] / noise[v]; q = draft row when HAS_Q, else one-hot
    # at excl_tok (excl_tok = -1: q = 0, i.e. plain sampling from p).  Falls back
    # to argmax p / noise when the residual is identically zero.
    # Reads V elements of p and noise (+ V of q when HAS_Q).
    best_r = -1.0
    idx_r = 0
    best_p = -1.0
    idx_p = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        ok = offs < V
        p = tl.load(p_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        e = tl.load(noise_ptr + offs, mask=ok, other=1.0).to(tl.float32)
        if HAS_Q:
            q = tl.load(q_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            r = tl.maximum(p - q, 0.0)
        else:
            r = tl.where(offs == excl_tok, 0.0, p)
        r = tl.where(ok, tl.div_rn(r, e), -1.0)
        pe = tl.where(ok, tl.div_rn(p, e), -1.0)
        m = tl.max(r, 0)
        i = tl.argmax(r, 0) + start
        upd = m > best_r
        idx_r = tl.where(upd, i, idx_r)
        best_r = tl.where(upd, m, best_r)
        m = tl.max(pe, 0)
        i = tl.argmax(pe, 0) + start
        upd = m > best_p
        idx_p = tl.where(upd, i, idx_p)
        best_p = tl.where(upd, m, best_p)
    return tl.where(best_r > 0.0, idx_r, idx_p)


@triton.jit
def _rejection_kernel(
    out_ptr,  # int64 [B, K+1]
    num_emitted_ptr,  # int64 [B]
    draft_ids_ptr,  # int64 [B, K]
    num_draft_ptr,  # int64 [B]
    draft_probs_ptr,  # [B, K, V] (dummy when not HAS_DRAFT_PROBS)
    target_ptr,  # [B, K+1, V]
    greedy_ptr,  # int8 [B]
    uniforms_ptr,  # [B, K]
    noise_ptr,  # [B, K+1, V]
    K, V,
    stride_ob, stride_db, stride_ub,
    stride_qb, stride_qk,
    stride_tb, stride_tk,
    stride_nb, stride_nk,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K + 1
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    # Step 1: per-request scalars.
    nd = tl.load(num_draft_ptr + b)
    greedy = tl.load(greedy_ptr + b) != 0
    t_base = target_ptr + b * stride_tb
    n_base = noise_ptr + b * stride_nb
    q_base = draft_probs_ptr + b * stride_qb
    i = nd * 0  # int64 scalar: number of accepted drafts
    rejected = 0
    final_tok = 0
    # Step 2: walk the drafts until the first rejection.  Per accepted position
    # a sampled row reads 3 scalars; a greedy row reads one V-row (argmax).
    while (i < nd) & (rejected == 0):
        x = tl.load(draft_ids_ptr + b * stride_db + i)
        if greedy:
            tgt = _argmax_row(t_base + i * stride_tk, V, BLOCK_V)
            if tgt == x:
                i += 1
            else:
                rejected = 1
                final_tok = tgt
        else:
            p_x = tl.load(t_base + i * stride_tk + x).to(tl.float32)
            if HAS_DRAFT_PROBS:
                q_x = tl.load(q_base + i * stride_qk + x).to(tl.float32)
            else:
                q_x = 1.0
            u = tl.load(uniforms_ptr + b * stride_ub + i).to(tl.float32)
            if u * q_x < p_x:
                i += 1
            else:
                # Step 3 (once): recovered token, reads 2-3 V-rows.
                rejected = 1
                final_tok = _sample_residual(t_base + i * stride_tk, q_base + i * stride_qk,
                                             n_base + i * stride_nk, x, V, HAS_DRAFT_PROBS, BLOCK_V)
    # Step 4 (all accepted): bonus token from target[b, nd], reads 1-2 V-rows.
    if rejected == 0:
        if greedy:
            final_tok = _argmax_row(t_base + nd * stride_tk, V, BLOCK_V)
        else:
            final_tok = _sample_residual(t_base + nd * stride_tk, t_base, n_base + nd * stride_nk,
                                         -1, V, False, BLOCK_V)
    # Step 5: write K+1 output ids (accepted drafts, final token, -1 padding).
    offs = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ids_ptr + b * stride_db + offs, mask=(offs < i) & (offs < K), other=-1)
    row = tl.where(offs < i, drafts, tl.where(offs == i, final_tok.to(tl.int64), -1))
    tl.store(out_ptr + b * stride_ob + offs, row, mask=offs < K + 1)
    tl.store(num_emitted_ptr + b, (i + 1).to(tl.int64))


def rejection_sample_triton(draft_token_ids, num_draft, draft_probs, target_probs, is_greedy, uniforms,
                            exp_noise) -> Tuple[torch.Tensor, torch.Tensor]:
    B, K = draft_token_ids.shape
    V = target_probs.shape[-1]
    dev = target_probs.device
    out = torch.empty(B, K + 1, dtype=torch.int64, device=dev)
    num_emitted = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out, num_emitted
    if exp_noise is None:
        exp_noise = torch.empty_like(target_probs, dtype=torch.float32).exponential_()
    drafts = draft_token_ids.to(torch.int64).contiguous()
    target = target_probs.contiguous()
    noise = exp_noise.contiguous()
    dp = draft_probs.contiguous() if draft_probs is not None else target
    uni = uniforms.contiguous() if K > 0 else torch.zeros(B, 1, device=dev)
    _rejection_kernel[(B,)](
        out, num_emitted, drafts, num_draft.to(torch.int64).contiguous(), dp, target,
        is_greedy.to(torch.int8).contiguous(), uni, noise, K, V,
        out.stride(0), drafts.stride(0), uni.stride(0),
        dp.stride(0), dp.stride(1), target.stride(0), target.stride(1), noise.stride(0), noise.stride(1),
        HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_K=_next_pow2(K + 1),
        BLOCK_V=min(_next_pow2(V), 2048), num_warps=8,
    )
    return out, num_emitted


def rejection_sample_ref(draft_token_ids, num_draft, draft_probs: Optional[torch.Tensor], target_probs,
                         is_greedy, uniforms, exp_noise) -> Tuple[torch.Tensor, torch.Tensor]:
    """Vectorised over the batch: only [B, K] / [B, V] intermediates (plus the
    greedy argmax over target_probs); no Python loop over requests or positions."""
    B, K = draft_token_ids.shape
    dev = target_probs.device
    ar = torch.arange(B, device=dev)
    if exp_noise is None:
        exp_noise = torch.empty_like(target_probs, dtype=torch.float32).exponential_()
    nd = num_draft.to(device=dev, dtype=torch.long)
    greedy = is_greedy.to(device=dev, dtype=torch.bool)
    drafts = draft_token_ids.to(device=dev, dtype=torch.long)
    valid = torch.arange(K, device=dev)[None, :] < nd[:, None]  # [B, K]
    safe = torch.where(valid, drafts, 0)

    # Acceptance tests for every draft position: [B, K].
    greedy_tok = target_probs.argmax(-1)  # [B, K+1]
    acc_greedy = drafts == greedy_tok[:, :K]
    p_x = target_probs[:, :K].gather(2, safe[..., None]).squeeze(-1).float()
    if draft_probs is not None:
        q_x = draft_probs.gather(2, safe[..., None]).squeeze(-1).float()
    else:
        q_x = torch.ones_like(p_x)
    acc_sampled = uniforms.float() * q_x < p_x
    accept = torch.where(greedy[:, None], acc_greedy, acc_sampled) & valid
    n_acc = torch.cumprod(accept.long(), dim=1).sum(1)  # accepted prefix length [B]
    rejected = n_acc < nd

    # Final (recovered or bonus) token, from position n_acc only: [B, V] work.
    p_f = target_probs[ar, n_acc].float()
    e_f = exp_noise[ar, n_acc].float()
    if K > 0:
        ri = n_acc.clamp(max=K - 1)
        if draft_probs is not None:
            resid = (p_f - draft_probs[ar, ri].float()).clamp_min(0.0)
        else:
            resid = p_f.scatter(1, safe[ar, ri][:, None], 0.0)
        resid = torch.where(rejected[:, None], resid, p_f)
    else:
        resid = p_f
    score = resid / e_f
    best, tok = score.amax(-1), score.argmax(-1)
    tok = torch.where(best > 0, tok, (p_f / e_f).argmax(-1))
    final = torch.where(greedy, greedy_tok[ar, n_acc], tok)

    out = torch.full((B, K + 1), -1, dtype=torch.long, device=dev)
    out[:, :K] = torch.where(torch.arange(K, device=dev)[None, :] < n_acc[:, None], drafts, -1)
    out[ar, n_acc] = final
    return out, n_acc + 1
