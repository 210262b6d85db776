"""`specserve train-draft`: train an EAGLE head (or Medusa heads) for a target by self-distillation.

Recipe (EAGLE's, scaled to a CPU):
  1. data: the target answers templated instruction prompts greedily (never Spec-Bench);
     its final hidden states are recorded for every token (specserve.spec_decode.training.data);
  2. vocabulary: the N most frequent tokens of the answers become the draft vocabulary
     (d2t); the head scores only those rows of the target's LM head;
  3. training: uniform noise on the input features. EAGLE: smooth-L1 to the next feature plus
     0.1 x cross-entropy to the target's next-token distribution (both on answer positions),
     over --unroll steps of "training-time test" (EAGLE-3's idea): step 1 is teacher forcing;
     step j feeds the head its own step j-1 predictions as features and attends exactly what a
     depth-j tree node sees at inference (the true pairs before its branch, its ancestors,
     itself), so deep drafts are trained on the errors they will meet. Step j's loss weighs
     0.8^(j-1). Medusa: cross-entropy of head k to the token k + 2 ahead.
Resumable: data chunks and a checkpoint (every --ckpt-minutes) live in --work-dir; --resume
continues from them. The head is exported to --out at each checkpoint and at the end.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.config import DEFAULT_MODEL

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: the CLI builds this parser for every
# command, and `specserve --help` should not pay for importing torch.


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=["eagle", "medusa"], default="eagle")
    p.add_argument("--target", default=DEFAULT_MODEL, help="target model (alias, dir or .gguf)")
    p.add_argument("--out", required=True, help="output directory of the trained head")
    p.add_argument("--work-dir", default=None, help="data and checkpoints (default: OUT/../.OUTNAME-work)")
    p.add_argument("--resume", action="store_true", help="continue from the work dir's checkpoint")
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=128, help="answer length per prompt")
    p.add_argument("--chunk", type=int, default=64, help="prompts per generation chunk")
    p.add_argument("--self-instruct", type=int, default=0,
                   help="also answer this many prompts the target writes itself (seed words from its vocabulary)")
    p.add_argument("--doc-prompts", type=int, default=0,
                   help="also answer this many long-context tasks over the target's earlier answers")
    p.add_argument("--gen-minutes", type=float, default=25.0, help="time budget for data generation")
    p.add_argument("--train-minutes", type=float, default=30.0, help="time budget for training")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0: full)")
    p.add_argument("--batch-seqs", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=None,
                   help="uniform feature noise width (default 0.2; 0 for a head with its own output norm)")
    p.add_argument("--unroll", type=int, default=3, help="eagle: training-time-test steps (1: teacher forcing)")
    p.add_argument("--init", default=None, help="eagle: start from this head directory's weights")
    p.add_argument("--aux-layers", default=None,
                   help="eagle: an EAGLE-3 head, its features fused from these target layers' outputs "
                        "(comma-separated indices, or 'auto': a low, a middle and a high layer)")
    p.add_argument("--feature-loss", type=float, default=None,
                   help="eagle: weight of the feature regression loss (default 1; 0 for a head with "
                        "its own output norm: an EAGLE-3 head trained from scratch)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the target's dtype while it generates the data")
    p.add_argument("--holdout", type=int, default=64, help="eagle: sequences kept out of training to report "
                   "per-depth agreement at each checkpoint")
    p.add_argument("--medusa-heads", type=int, default=4)
    p.add_argument("--ckpt-minutes", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)


def parse_aux_layers(value: str | None, num_layers: int) -> tuple[int, ...]:
    """--aux-layers -> increasing target layer indices; 'auto': EAGLE-3's low, middle and high
    layers (2, L/2 and L-3 of L; fewer when the target has fewer than 6)."""
    if not value:
        return ()
    if value == "auto":
        return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3)}))
    layers = tuple(int(v) for v in value.split(","))
    if any(not 0 <= i < num_layers for i in layers) or list(layers) != sorted(set(layers)):
        raise ValueError(f"train-draft: --aux-layers {value}: increasing indices below {num_layers}")
    return layers


def _ensure_data(args: argparse.Namespace, work: Path, log) -> None:
    """Generate whatever chunks are missing, within --gen-minutes: template prompts
    (chunk_*.pt), then self-instruct prompts (si_*.pt, their prompts kept in
    self_instruct.json), then document tasks (doc_*.pt) over the answers already on disk."""
    import json
    from functools import partial

    import torch

    from specserve.spec_decode.eagle import PROMPT_WINDOW
    from specserve.spec_decode.training.data import (document_prompts, generate_chunks, instruction_prompts,
                                           self_instruct_prompts, self_instruct_words)

    data = work / "data"
    deadline = time.time() + 60 * args.gen_minutes
    wanted = {"chunk": args.num_prompts, "si": args.self_instruct, "doc": args.doc_prompts}
    if args.gen_minutes <= 0 or all(len(list(data.glob(f"{prefix}_*.pt"))) >= -(-n // args.chunk)
                                    for prefix, n in wanted.items()):
        return
    from specserve import LLM

    # plain decoding: every computed row is then a committed token whose features are recorded
    llm = LLM(args.target, max_model_len=args.max_model_len, enable_prefix_caching=False,
              max_num_seqs=args.chunk, max_num_batched_tokens=4096, speculative_config=None, dtype=args.dtype)
    aux = parse_aux_layers(args.aux_layers, llm.engine.runner.arch.num_layers)
    llm.engine.runner.set_aux_layers(aux)
    # EAGLE-3 data keeps the prompt's last PROMPT_WINDOW tokens (four times the rows per token)
    gen = partial(generate_chunks, prompt_rows=PROMPT_WINDOW if aux else None)
    gen(llm, instruction_prompts(args.num_prompts, args.seed), data, args.chunk, args.max_tokens, deadline, log)
    if args.self_instruct > 0 and time.time() < deadline:
        path = work / "self_instruct.json"
        saved = json.loads(path.read_text()) if path.exists() else {"requested": 0, "prompts": []}
        if isinstance(saved, list):  # written before the set could grow
            saved = {"requested": len(saved), "prompts": saved}
        have = saved["requested"]
        if args.self_instruct > have:  # a new set, or a larger one: new seed words only
            new = self_instruct_prompts(llm, args.self_instruct - have, args.seed, log,
                                        skip=self_instruct_words(have))
            saved = {"requested": args.self_instruct, "prompts": list(dict.fromkeys(saved["prompts"] + new))}
            path.write_text(json.dumps(saved, indent=0))
        gen(llm, saved["prompts"], data, args.chunk, args.max_tokens, deadline, log, prefix="si")
    if args.doc_prompts > 0 and time.time() < deadline:
        path = work / "doc_prompts.json"
        if not path.exists():  # documents: the answers on disk (decoded once, then kept)
            tok = llm.get_tokenizer()
            texts = [tok.decode(s["tokens"][s["prompt_len"]:].tolist(), skip_special_tokens=True).strip()
                     for f in sorted(data.glob("chunk_*.pt")) + sorted(data.glob("si_*.pt"))
                     for s in torch.load(f, map_location="cpu")]
            texts = [t for t in texts if len(t) > 80]
            if len(texts) >= 5:
                path.write_text(json.dumps(document_prompts(texts, args.doc_prompts, args.seed), indent=0))
        if path.exists():
            gen(llm, json.loads(path.read_text()), data, args.chunk, args.max_tokens, deadline, log, prefix="doc")
    del llm


def grow_eagle3(head, aux: tuple[int, ...], max_positions: int):
    """An EAGLE-3 head (features fused from the final hidden state and the target layers `aux`)
    that computes exactly what the EAGLE-2 `head` does: its weights, and a fusion that passes
    the final hidden state through (identity) and the inner layers' outputs not at all (zero),
    for training to take them in from there. No output norm: its outputs stay features."""
    import torch

    from specserve.spec_decode.eagle_head import EagleHead

    grown = EagleHead(head.arch, max_positions, fc_bias=head.fc.bias is not None,
                      input_norm=head.layers[0].input_layernorm is not None, aux_layers=aux)
    grown.load_state_dict(head.state_dict(), strict=False)
    h = head.arch.hidden_size
    with torch.no_grad():
        grown.fuse.weight.zero_()
        grown.fuse.weight[:, :h] = torch.eye(h)
    return grown


def _target_weights(target: str):
    from specserve.model.arch import ModelArch
    from specserve.model.loader import load_safetensors, resolve_model_dir

    model_dir = resolve_model_dir(target)
    arch = ModelArch.from_dir(model_dir)
    state = load_safetensors(model_dir)
    embed = state["model.embed_tokens.weight"].float()
    lm_head = embed if arch.tie_word_embeddings else state["lm_head.weight"].float()
    return arch, embed, lm_head


def build_draft_vocab(seqs: list[dict], n: int, vocab: int) -> torch.Tensor | None:
    """The n most frequent answer tokens, ascending ids (None: the full vocabulary)."""
    import torch

    if n <= 0 or n >= vocab:
        return None
    counts = Counter()
    for s in seqs:
        counts.update(s["tokens"][s["prompt_len"]:].tolist())
    top = [t for t, _ in counts.most_common(n)]
    rest = [t for t in range(vocab) if t not in counts][:n - len(top)]  # pad small data sets
    return torch.tensor(sorted(top + rest), dtype=torch.int64)


def _batch(seqs: list[dict], embed: torch.Tensor):
    """Pairs (f_t, x_{t+1}) -> targets f_{t+1}, next tokens x_{t+2}; padded to the longest.
    With "aux" in the sequences (an EAGLE-3 head's data) the input features are the final
    hidden states followed by those rows."""
    import torch

    aux = "aux" in seqs[0]
    lens = [s["hidden"].shape[0] - 1 for s in seqs]
    T, B, H = max(lens), len(seqs), embed.shape[1]
    feats = torch.zeros(B, T, H + (seqs[0]["aux"].shape[1] if aux else 0))
    target = torch.zeros(B, T, H)
    tokens_in = torch.zeros(B, T, dtype=torch.int64)
    tokens_next = torch.full((B, T), -1, dtype=torch.int64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(seqs, lens)):
        hid, tok = s["hidden"].float(), s["tokens"].long()
        feats[b, :n, :H], target[b, :n] = hid[:n], hid[1:n + 1]
        if aux:
            feats[b, :n, H:] = s["aux"][:n].float()
        tokens_in[b, :n] = tok[1:n + 1]
        nxt = tok[2:n + 2]
        tokens_next[b, :len(nxt)] = nxt
        mask[b, max(0, s["prompt_len"] - 2):n] = True  # targets that predict answer tokens
    mask &= tokens_next >= 0
    return feats, embed[tokens_in], target, tokens_next, mask


def ttt_mask(t: int, step: int) -> torch.Tensor:
    """[t, step * t] bool: what the pair at position i of unroll step `step` (1-based) attends.

    Keys are the steps' keys side by side. A step-j query at position i is a depth-j tree node:
    it sees step 1's (true) pairs up to position i - j + 1, where its branch leaves the
    committed text, then one ancestor per step in between, at positions i - j + 2 .. i - 1, and
    itself at step j, position i."""
    import torch

    q = torch.arange(t)[:, None]
    s = torch.arange(t)[None, :]
    blocks = [s <= q - step + 1] + [s == q - step + j for j in range(2, step + 1)]
    return torch.cat(blocks, 1)


def unrolled(head, feats: torch.Tensor, embeds: torch.Tensor, steps: int,
             noise: float = 0.0) -> list[torch.Tensor]:
    """The head's predicted next features at every position for unroll steps 1..steps.

    Step 1 reads the pairs (f_i, x_{i+1}) (an EAGLE-3 head: f_i fused from the aux rows), with
    uniform noise of width `noise` on f_i; step j reads (step j-1's prediction at i - 1,
    x_{i+1}) at position i, under ttt_mask. Each step's output at i estimates f_{i+1} (an
    EAGLE-3 head's: the input of its norm and the LM head; positions i < j - 1 of step j have
    no input and are junk)."""
    import torch

    if head.fuse is not None:
        feats = head.fuse(head.fuse_input(feats))
    if noise:
        feats = feats + (torch.rand_like(feats) - 0.5) * noise
    b, t, _ = feats.shape
    pos = torch.arange(t)
    out, k, v = head(feats, embeds, pos)
    outs, keys, values = [out], [k], [v]
    for j in range(2, steps + 1):
        shifted = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)
        out, k, v = head(shifted, embeds, pos, torch.cat(keys, 1), torch.cat(values, 1), ttt_mask(t, j)[None])
        outs.append(out)
        keys.append(k)
        values.append(v)
    return outs


def _with_input(mask: torch.Tensor, j: int) -> torch.Tensor:
    """The positions of `mask` that unroll step j + 1 (0-based j) has an input for: i >= j."""
    ok = mask.clone()
    ok[:, :j] = False
    return ok


def _draft_logits(head, pred: torch.Tensor, lm_sub: torch.Tensor) -> torch.Tensor:
    """The head's outputs -> draft logits, as EagleProposer computes them."""
    return (pred if head.norm is None else head.norm(pred)) @ lm_sub.T


def _eagle_loss(head, batch, lm_sub, t2d, noise: float, steps: int = 1, feature_loss: float | None = None):
    """EAGLE: smooth-L1 to the next feature + 0.1 x cross-entropy to the target's next-token
    distribution; a head with its own output norm (EAGLE-3): the cross-entropy alone
    (feature_loss: the first term's weight instead, default 1 and 0)."""
    import torch
    import torch.nn.functional as F

    feats, embeds, target, nxt, mask = batch
    normed = head.norm is not None
    wv = feature_loss if feature_loss is not None else (0.0 if normed else 1.0)
    wp = 1.0 if normed else 0.1
    tgt = target[mask]
    with torch.no_grad():
        p_t = F.softmax(tgt @ lm_sub.T, -1)
    total, stats = 0.0, {}
    for j, pred in enumerate(unrolled(head, feats, embeds, steps, noise)):
        ok = _with_input(mask, j)
        keep = ok[mask]  # ok's positions among mask's, for the per-position targets above
        pred = pred[ok]
        vloss = F.smooth_l1_loss(pred, tgt[keep]) if wv else torch.zeros(())
        logp = F.log_softmax(_draft_logits(head, pred, lm_sub), -1)
        ploss = -(p_t[keep] * logp).sum(-1).mean()
        total = total + (0.8 ** j) * (wv * vloss + wp * ploss)
        acc = (t2d[nxt[ok]] == logp.argmax(-1)).float().mean()
        sfx = "" if j == 0 else str(j + 1)
        stats.update({f"vloss{sfx}": vloss.item(), f"ploss{sfx}": ploss.item(), f"acc{sfx}": acc.item()})
    return total, stats


def depth_agreement(head, seqs: list[dict], embed, lm_sub, t2d, steps: int, batch: int = 16) -> list[float]:
    """Per unroll step j, how often the head's top-1 draft at depth j equals the target's token
    when the drafts before it were right (answer positions): the acceptance of a chain draft
    depth by depth."""
    import torch

    hits, count = [0] * steps, [0] * steps
    with torch.inference_mode():
        for i in range(0, len(seqs), batch):
            feats, embeds, _, nxt, mask = _batch(seqs[i:i + batch], embed)
            for j, pred in enumerate(unrolled(head, feats, embeds, steps)):
                ok = _with_input(mask, j)
                hits[j] += (t2d[nxt[ok]] == _draft_logits(head, pred[ok], lm_sub).argmax(-1)).sum().item()
                count[j] += ok.sum().item()
    return [h / max(1, c) for h, c in zip(hits, count)]


def _medusa_loss(heads, batch, lm_sub, t2d, noise: float):
    import torch
    import torch.nn.functional as F

    feats, _, _, nxt, mask = batch  # nxt[t] = x_{t+2}: head 0's label at f_t
    total, stats = 0.0, {}
    logits = heads.logits(feats[mask], lambda f: f @ lm_sub.T)  # [K, N, V']
    b_idx, t_idx = mask.nonzero(as_tuple=True)
    for k in range(heads.num_heads):
        t_lab = t_idx + k
        ok = t_lab < nxt.shape[1]
        lab = torch.full_like(t_idx, -1)
        lab[ok] = nxt[b_idx[ok], t_lab[ok]]
        lab = torch.where(lab >= 0, t2d[lab.clamp_min(0)], -1)
        loss = F.cross_entropy(logits[k], lab, ignore_index=-1)
        total = total + loss * (0.8 ** k)
        labelled = lab >= 0
        hits = ((logits[k].argmax(-1) == lab) & labelled).float().sum().item()
        stats[f"acc{k}"] = hits / max(1, labelled.sum().item())
    return total, stats


def _export(method: str, model, d2t, out: Path, extra: dict) -> None:
    from specserve.spec_decode.training.checkpoints import save_eagle, save_medusa

    if method == "eagle":
        save_eagle(model, d2t, out, extra=extra)
    else:
        save_medusa(model, d2t, out)


def run(args: argparse.Namespace) -> None:
    import torch

    from tqdm import tqdm

    if args.unroll < 1:
        raise ValueError("train-draft: --unroll must be >= 1")
    if args.init and args.method != "eagle":
        raise ValueError("train-draft: --init applies to --method eagle only")
    if args.aux_layers and args.method != "eagle":
        raise ValueError("train-draft: --aux-layers applies to --method eagle only")

    torch.manual_seed(args.seed)
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out.parent / f".{out.name}-work"
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / f"ckpt-{args.method}.pt"
    log_start = time.time()

    def log(msg: str) -> None:
        tqdm.write(f"[train-draft {time.time() - log_start:7.0f}s] {msg}")

    # 1. data (chunks already on disk are kept: generation resumes by itself)
    _ensure_data(args, work, log)
    files = sorted((work / "data").glob("*.pt"))
    seqs = [s for f in files for s in torch.load(f, map_location="cpu") if s["hidden"].shape[0] >= 3]
    arch, embed, lm_head = _target_weights(args.target)
    aux = parse_aux_layers(args.aux_layers, arch.num_layers)
    if aux and seqs and "aux" not in seqs[0]:
        raise ValueError(f"train-draft: the data in {work / 'data'} has no aux layer outputs: an "
                         "EAGLE-3 head needs data generated with --aux-layers")
    if not aux:  # an EAGLE-2 head (or Medusa) on an EAGLE-3 head's data: the final hidden states
        for s in seqs:
            s.pop("aux", None)
    if not seqs:
        raise ValueError(f"train-draft: no training data in {work / 'data'} "
                         "(generate some with --gen-minutes > 0)")
    held: list[dict] = []  # eagle: kept out of training and of the draft vocabulary
    if args.method == "eagle" and 0 < args.holdout < len(seqs):
        held, seqs = seqs[len(seqs) - args.holdout:], seqs[:len(seqs) - args.holdout]
    n_ans = sum(len(s["tokens"]) - s["prompt_len"] for s in seqs)
    log(f"data: {len(seqs)} training sequences ({n_ans} answer tokens) and {len(held)} held out, "
        f"from {len(files)} chunks")

    # 2. vocabulary
    d2t = build_draft_vocab(seqs, args.draft_vocab, arch.vocab_size)
    t2d = torch.arange(arch.vocab_size) if d2t is None else torch.full((arch.vocab_size,), -1).index_put_(
        (d2t,), torch.arange(d2t.numel()))
    lm_sub = lm_head if d2t is None else lm_head[d2t].contiguous()
    if d2t is not None:
        covered = sum((t2d[s["tokens"][s["prompt_len"]:].long()] >= 0).sum().item() for s in seqs)
        log(f"vocab: {d2t.numel()} draft tokens cover {covered / max(1, n_ans):.3%} of answer tokens")

    # 3. model, optimiser, checkpoint
    report = None  # logs the held-out agreement by depth (eagle)
    if args.method == "eagle":
        from dataclasses import replace

        from specserve.spec_decode.eagle_head import EagleHead

        if args.init:
            from specserve.spec_decode.heads_io import load_eagle

            model = load_eagle(args.init, arch, args.max_model_len + 64)[0]
            if aux and model.fuse is None:
                model = grow_eagle3(model, aux, args.max_model_len + 64)
                log(f"initialised from {args.init}, features fused with target layers {aux}")
            else:
                log(f"initialised from {args.init}")
        else:
            # the target's layer shape
            model = EagleHead(replace(arch, num_layers=1), args.max_model_len + 64, aux_layers=aux,
                              out_norm=bool(aux))
        if tuple(model.aux_layers) != aux:
            raise ValueError(f"train-draft: --init {args.init} reads target layers {model.aux_layers}, "
                             f"--aux-layers says {aux}")

        def loss_fn(model, batch, lm_sub, t2d, noise):
            noise = noise if noise is not None else (0.2 if model.norm is None else 0.0)
            return _eagle_loss(model, batch, lm_sub, t2d, noise, args.unroll, args.feature_loss)

        if held:
            def report() -> None:
                model.eval()
                acc = depth_agreement(model, held, embed, lm_sub, t2d, max(args.unroll, 4))
                log(f"held-out agreement by depth ({len(held)} sequences): "
                    + " ".join(f"d{j + 1}={a:.3f}" for j, a in enumerate(acc)))
    else:
        from specserve.spec_decode.medusa_heads import MedusaHeads

        model = MedusaHeads(args.medusa_heads, 1, arch.hidden_size)
        loss_fn = _medusa_loss
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(seqs) / args.batch_seqs)
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(
        0.05, 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total))))))
    step = 0
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
        log(f"resumed at step {step}")
    extra = {"trained_by": "specserve train-draft", "target": args.target}

    def checkpoint() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "step": step}, tmp)
        tmp.replace(ckpt_path)
        _export(args.method, model, d2t, out, extra)
        if report:
            report()

    # 4. train: epoch e visits the sequences in a permutation seeded by e (resumable by step)
    deadline = time.time() + 60 * args.train_minutes
    last_ckpt, avg = time.time(), {}
    if step == 0 and report:
        report()
    bar = tqdm(total=total, initial=step, desc=f"train {args.method}", mininterval=10)
    while step < total and time.time() < deadline:
        epoch, i = divmod(step, steps_per_epoch)
        perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        idx = perm[i * args.batch_seqs:(i + 1) * args.batch_seqs].tolist()
        model.train()
        loss, stats = loss_fn(model, _batch([seqs[j] for j in idx], embed), lm_sub, t2d, args.noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        step += 1
        avg = {k: 0.98 * avg.get(k, v) + 0.02 * v for k, v in stats.items()}
        bar.update(1)
        if step % 50 == 0:
            bar.set_postfix({k: f"{v:.3f}" for k, v in avg.items()})
            log(f"step {step}/{total} epoch {epoch} " + " ".join(f"{k}={v:.3f}" for k, v in avg.items()))
        if time.time() - last_ckpt > 60 * args.ckpt_minutes:
            checkpoint()
            last_ckpt = time.time()
    bar.close()
    model.eval()
    checkpoint()
    log(f"done at step {step}/{total}; head written to {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specserve train-draft", description=__doc__.split("\n")[0])
    add_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
