"""benchmarks/kernels.py's and benchmarks/attention_tune.py's smoke runs on the CPU (kernels
interpreted, flex skipped): they run end to end, the sweep's summary compares every case with
SDPA and says why flex has no figure, the tuning run times every combination it may."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "kernels.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on CUDA run the benchmark itself")
def test_kernel_benchmark_smoke_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--device", "cpu", "--contexts", "40", "--batches", "2", "--tree-sizes", "5",
                     "--prefill-chunks", "8,64", "--prefill-batches", "2",
                     "--num-q-heads", "4", "--num-kv-heads", "2", "--head-dim", "16", "--skip", "flex",
                     "--peak-gbps", "100", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "kernels.json").read_text())
    summary = {(r["kind"], r["batch"], r["context"], r["q_per_seq"]): r for r in report["summary"]}
    # (a chunk longer than the context is no case)
    assert set(summary) == {("decode", 2, 40, 1), ("tree", 2, 40, 5), ("prefill", 2, 40, 8)}
    assert all(r["vs_sdpa"] > 0 for r in summary.values())
    assert summary[("tree", 2, 40, 5)]["flex_note"] == "skipped (--skip flex)"
    ours = [r for r in report["results"] if r["impl"] == "triton"]
    assert len(ours) == 3 and all(0 < r["peak_frac"] == r["gbps"] / 100 for r in ours)
    others = [r for r in report["results"] if r["impl"] != "triton"]
    assert others and max(r["max_abs_err"] for r in others) < 1e-4  # baselines agree with ours
    assert bench.device_peak_gbps("NVIDIA H200") == 4800 and bench.device_peak_gbps("NVIDIA H100 80GB HBM3") == 3350
    assert bench.device_peak_gbps("Some GPU") is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on CUDA run the script itself")
def test_attention_tuning_smoke_run(tmp_path):
    from specserve.kernels.triton import paged_attention as pa

    spec = importlib.util.spec_from_file_location("attention_tune", BENCH.parent / "attention_tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    shipped = (dict(pa.CONFIG[64]), pa.BLOCK_M, pa.PARTITION_SIZE)
    assert tune.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "attention_tune.json").read_text())["results"]
    # the descent starts at the shipped constants, then moves one knob at a time
    assert (results[0]["block_m"], results[0]["prefetch"]) == (64, 0)
    assert {(r["block_m"], r["prefetch"]) for r in results[1:]} <= {(64, 1), (16, 0), (16, 1)}
    assert 3 <= len(results) <= 4
    assert all("error" not in r and r["geomean_vs_sdpa"] > 0 and len(r["cases"]) == 2 for r in results)
    assert (pa.CONFIG[64], pa.BLOCK_M, pa.PARTITION_SIZE) == shipped  # put back after the run


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on CUDA run the script itself")
def test_matmul_tuning_smoke_run_and_its_invariance_check(tmp_path, monkeypatch):
    """benchmarks/matmul_tune.py under the interpreter: the descent from the shipped constants
    times each combination against F.linear and puts the constants back; a kernel whose rows
    depend on the call's row count is reported as not batch-invariant, never ranked."""
    from specserve.kernels.triton import matmul as mm

    spec = importlib.util.spec_from_file_location("matmul_tune", BENCH.parent / "matmul_tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    shipped = (mm.BLOCK_M, mm.BLOCK_N, mm.BLOCK_K, mm.NUM_WARPS, mm.NUM_STAGES, mm.SPLIT_K)
    assert tune.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "matmul_tune.json").read_text())["results"]
    assert (results[0]["block_n"], results[0]["num_stages"]) == (mm.BLOCK_N, mm.NUM_STAGES)
    assert len(results) >= 2 and all("error" not in r and r["geomean_vs_cublas"] > 0 for r in results)
    assert all(set(r["vs_cublas_by_rows"]) == {"1", "3"} and len(r["cases"]) == 4 for r in results)
    assert (mm.BLOCK_M, mm.BLOCK_N, mm.BLOCK_K, mm.NUM_WARPS, mm.NUM_STAGES, mm.SPLIT_K) == shipped

    real = mm.linear_invariant_triton
    monkeypatch.setattr(mm, "linear_invariant_triton",  # a last-bit change that depends on the rows
                        lambda x, w, b=None, split_k=mm.SPLIT_K: real(x, w, b, split_k) * (1 + 1e-6 * (x.shape[0] > 1)))
    assert tune.main(["--device", "cpu", "--quick", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "matmul_tune.json").read_text())["results"]
    assert results and all("not batch-invariant" in r["error"] for r in results)
