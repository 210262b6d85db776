"""`specserve train-draft` end to end on a tiny random target: the three data sources, unrolled
training, the exported head, and --resume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve.model.arch import ModelArch


def tiny_target(path: Path) -> Path:
    """A random 2-layer Llama with the default model's tokenizer (full vocabulary)."""
    from safetensors.torch import save_file

    from specserve.model.loader import resolve_model_dir

    src = resolve_model_dir("smollm2-135m-instruct")
    path.mkdir()
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")) or f.suffix == ".jinja":
            shutil.copy(f, path / f.name)
    base = json.loads((src / "config.json").read_text())
    cfg = {**base, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": True}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    h, i, v = 32, 64, cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(2):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (16, h),
                       p + "self_attn.v_proj.weight": (16, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    state = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=g) * 0.2)
             for k, s in shapes.items()}
    save_file(state, str(path / "model.safetensors"))
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve", "train-draft", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # trains a head end to end: make test-all
def test_train_draft_end_to_end_and_resume(tmp_path):
    from specserve.spec_decode.heads_io import load_eagle

    target = tiny_target(tmp_path / "target")
    out, work = tmp_path / "head", tmp_path / "work"
    common = ["--method", "eagle", "--target", str(target), "--out", str(out), "--work-dir", str(work),
              "--num-prompts", "4", "--self-instruct", "3", "--doc-prompts", "2", "--chunk", "2",
              "--max-tokens", "24", "--max-model-len", "512", "--draft-vocab", "64", "--unroll", "2",
              "--holdout", "1", "--epochs", "2", "--batch-seqs", "2"]
    done = run_cli(*common)
    assert done.returncode == 0, done.stderr[-2000:]
    data = work / "data"
    assert len(list(data.glob("chunk_*.pt"))) == 2 and list(data.glob("si_*.pt")) and list(data.glob("doc_*.pt"))
    assert json.loads((work / "doc_prompts.json").read_text())
    assert "held-out agreement by depth" in done.stderr + done.stdout
    head, d2t, _ = load_eagle(out, ModelArch.from_dir(target))
    assert d2t.numel() == 64 and head.fc.weight.shape == (32, 64)
    before = {f: f.stat().st_mtime for f in data.glob("*.pt")}
    again = run_cli(*common, "--resume", "--epochs", "3")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed at step" in again.stderr + again.stdout
    assert {f: f.stat().st_mtime for f in data.glob("*.pt")} == before  # no data regenerated
    first = json.loads((work / "self_instruct.json").read_text())
    assert first["requested"] == 3
    i = common.index("--self-instruct")
    grow = [*common[:i + 1], "8", *common[i + 2:]]  # 3 -> 8 prompts: 6 new seed words, none repeated
    more = run_cli(*grow, "--resume", "--epochs", "3")
    assert more.returncode == 0, more.stderr[-2000:]
    grown = json.loads((work / "self_instruct.json").read_text())
    assert grown["requested"] == 8 and grown["prompts"][:len(first["prompts"])] == first["prompts"]
    assert len(grown["prompts"]) > len(first["prompts"])
    assert all(f.stat().st_mtime == t for f, t in before.items())  # earlier chunks kept
    assert len(list(data.glob("si_*.pt"))) > len([f for f in before if f.name.startswith("si_")])


def test_eagle_only_options_fail_fast_for_medusa(tmp_path):
    bad = run_cli("--method", "medusa", "--init", str(tmp_path / "head"), "--out", str(tmp_path / "out"))
    assert bad.returncode == 2 and "--init applies to --method eagle only" in bad.stderr
    assert not (tmp_path / ".out-work").exists()  # nothing generated or created before the check
    bad = run_cli("--method", "medusa", "--aux-layers", "auto", "--out", str(tmp_path / "out"))
    assert bad.returncode == 2 and "--aux-layers applies to --method eagle only" in bad.stderr
    assert not (tmp_path / ".out-work").exists()


def test_train_draft_an_eagle3_head(tmp_path):
    """--aux-layers: the data records the inner layers' outputs (each prompt's last
    PROMPT_WINDOW tokens kept: all a head's first pass reads), the head fuses them, saves its
    layers, and drafts in the engine losslessly; an EAGLE-2 head trains on the same data (its
    final hidden states)."""
    from specserve import LLM, SamplingParams
    from specserve.spec_decode.eagle import PROMPT_WINDOW
    from specserve.spec_decode.heads_io import load_eagle

    target = tiny_target(tmp_path / "target")
    out, work = tmp_path / "head", tmp_path / "work"
    common = ["--method", "eagle", "--target", str(target), "--work-dir", str(work), "--num-prompts", "4",
              "--doc-prompts", "2", "--chunk", "2", "--max-tokens", "24", "--max-model-len", "512",
              "--draft-vocab", "64", "--unroll", "2", "--holdout", "1", "--epochs", "1", "--batch-seqs", "2"]
    done = run_cli(*common, "--out", str(out), "--aux-layers", "auto")
    assert done.returncode == 0, done.stderr[-2000:]
    seqs = [s for f in sorted((work / "data").glob("*.pt")) for s in torch.load(f)]
    assert all(s["aux"].shape == (s["hidden"].shape[0], 64) and s["prompt_len"] <= PROMPT_WINDOW for s in seqs)
    assert any(s["prompt_len"] == PROMPT_WINDOW for s in seqs)  # the document tasks' prompts, cut
    assert json.loads((out / "config.json").read_text())["eagle_aux_layers"] == [0, 1]
    head = load_eagle(out, ModelArch.from_dir(target))[0]
    assert head.fuse.weight.shape == (32, 96) and head.norm is not None
    eagle2 = run_cli(*common, "--out", str(tmp_path / "eagle2"), "--gen-minutes", "0")
    assert eagle2.returncode == 0, eagle2.stderr[-2000:]
    assert load_eagle(tmp_path / "eagle2", ModelArch.from_dir(target))[0].fuse is None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, {"prompt_token_ids": [9, 8, 7]}]
    plain = LLM(str(target), max_model_len=256, speculative_config=None).generate(prompts, params)
    spec = LLM(str(target), max_model_len=256, speculative_config={
        "method": "eagle", "model": str(out), "adaptive": False, "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain]
    assert spec.engine.stats.spec_num_drafts > 0


@pytest.mark.slow  # three engines of the default model: make test-all
def test_eval_draft_measures_several_heads_on_a_split_of_the_load_prompts(capsys):
    """eval_draft: one plain reference, then each head in turn (`shipped` or a directory) on
    the first prompts of bench load's held-out split; every head's output equals plain's."""
    from specserve.spec_decode.eagle import DEFAULT_EAGLE_DIR
    from specserve.spec_decode.training import eval_draft

    eval_draft.main(["--head", "shipped", str(DEFAULT_EAGLE_DIR), "--m", "4", "--depth", "2", "--topk", "2",
                     "--tokens", "8", "--prompts", "heldout", "--num-prompts", "2"])
    lines = capsys.readouterr().out.splitlines()
    plain = [line for line in lines if line.startswith("plain greedy:")]
    assert len(plain) == 1 and "for 2 x 8 tokens" in plain[0]
    heads = [line for line in lines if line.startswith("eagle [")]
    assert len(heads) == 2 and heads[0].startswith("eagle [shipped] m=4 depth=2 topk=2:")
    assert heads[1].startswith(f"eagle [{DEFAULT_EAGLE_DIR}]")
    assert all(line.endswith("equal to plain: True") for line in heads)
