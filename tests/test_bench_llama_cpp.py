"""benchmarks/llama_cpp.py without a llama.cpp build: it says how to get one and exits 0; its
table reads each engine against llama.cpp. (The side-by-side run itself needs the build and
minutes of CPU: docs/benchmarks.md has its figures.)"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "llama_cpp.py"


def test_without_a_build_it_skips_with_a_message(tmp_path):
    env = {**os.environ, "SPECSERVE_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, str(SCRIPT), "--concurrency", "1"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "llama-server not found" in r.stdout and "--build" in r.stdout


def test_bad_options_are_refused():
    r = subprocess.run([sys.executable, str(SCRIPT), "--concurrency", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "at least 1" in r.stderr


def test_table_gives_each_engine_against_llama_cpp():
    spec = importlib.util.spec_from_file_location("llama_cpp_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.table({"tok_per_s": {"llama.cpp": {1: 60.0, 8: 120.0}, "plain": {1: 15.0, 8: 60.0}}}, [1, 8])
    plain = next(line for line in text.splitlines() if line.startswith("plain"))
    assert "0.25x" in plain and "0.50x" in plain


def test_without_llama_cpp_each_engine_is_against_the_first():
    spec = importlib.util.spec_from_file_location("llama_cpp_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.table({"reference": "plain", "tok_per_s": {"plain": {1: 80.0, 8: 300.0},
                                                          "default": {1: 88.0, 8: 294.0}}}, [1, 8])
    assert "vs plain" in text.splitlines()[0]
    default = next(line for line in text.splitlines() if line.startswith("default"))
    assert "1.10x" in default and "0.98x" in default


def test_every_engine_runs_with_each_weight_format():
    spec = importlib.util.spec_from_file_location("llama_cpp_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.argparse.Namespace(max_model_len=512, concurrency=[1, 8], dtype="auto", quantization=["none", "int8"],
                                  engine=["plain=none", "default=auto"])
    servers = dict(mod.engines(args, Path("m.gguf"), Path("llama-server")))
    assert list(servers) == ["llama.cpp", "plain", "default", "plain int8", "default int8"]
    argv = servers["default int8"]
    assert argv[argv.index("--quantization") + 1] == "int8" and argv[argv.index("--speculative-config") + 1] == "auto"
