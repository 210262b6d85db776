"""InvariantAttention of this checkout against another checkout's, in one process: one step's
attention over the default model's shapes (3 KV heads, 3 query heads each, head size 64, 30
layers) for a decode token, a chain of 4 verify rows and trees of 4 and 8 nodes, at a few
context lengths. The two versions alternate run by run, so machine drift hits both alike;
the outputs must be equal where both versions compute the same arithmetic (--check).

    python benchmarks/experiments/attention_ab.py --base /path/to/other/checkout [--contexts 300 1500 3000] \\
        [--runs 25] [--check]
"""

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# name: (query rows, tree parents or None for causal rows)
CASES = {"decode": (1, None), "chain4": (4, None), "tree4": (4, [-1, 0, 0, 1]),
         "tree8": (8, [-1, 0, 0, 1, 1, 2, 3, 4])}


def load_attention(checkout: Path, name: str):
    """A checkout's specserve/model/attention: the package, or the single module it once was."""
    package = checkout / "specserve" / "model" / "attention"
    if (package / "__init__.py").is_file():  # its relative imports resolve inside `name`
        spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                      submodule_search_locations=[str(package)])
    elif package.with_suffix(".py").is_file():
        spec = importlib.util.spec_from_file_location(name, package.with_suffix(".py"))
    else:
        raise SystemExit(f"attention_ab: no specserve/model/attention.py or attention/ under {checkout}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def invariant_step(mod, seq_lens, query_lens, tables, block, parents):
    """(InvariantAttention, its metadata for the step) from either version of the module."""
    import torch

    backend = mod.InvariantAttention()
    if hasattr(backend, "build_metadata"):
        return backend, backend.build_metadata(seq_lens, query_lens, tables, block, torch.device("cpu"), parents)
    # a checkout from before the attention package: the metadata is built by layout name
    return backend, mod.AttentionMetadata.build(seq_lens, query_lens, tables, block, torch.device("cpu"),
                                                "logical", parents)


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="the other checkout (its root directory)")
    p.add_argument("--contexts", type=int, nargs="+", default=[300, 1500, 3000])
    p.add_argument("--runs", type=int, default=25)
    p.add_argument("--check", action="store_true", help="fail unless both versions give equal outputs")
    args = p.parse_args()
    here = Path(__file__).resolve().parents[2]
    versions = {"base": load_attention(args.base.resolve(), "_attention_base"),
                "this": load_attention(here, "_attention_this")}
    kv_heads, group, head_dim, block, layers = 3, 3, 64, 16, 30
    num_blocks = max(args.contexts) // block + 2
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).bfloat16()
    table = list(range(num_blocks))
    print(f"ms per step of {layers} layers (min / median of {args.runs}), {torch.get_num_threads()} threads")
    print(f"{'context':>8} {'step':<8}" + "".join(f"{v + ' min':>11}{v + ' med':>11}" for v in versions)
          + f"{'this/base':>11}")
    for context in args.contexts:
        for case, (n, parents) in CASES.items():
            q = torch.randn(n, kv_heads * group, head_dim, generator=gen).bfloat16()
            k = torch.randn(n, kv_heads, head_dim, generator=gen).bfloat16()
            v = torch.randn(n, kv_heads, head_dim, generator=gen).bfloat16()
            times = {name: [] for name in versions}
            outs = {}
            with torch.inference_mode():
                for _ in range(args.runs + 1):  # the first run warms up
                    for name, mod in versions.items():
                        start = time.perf_counter()
                        backend, meta = invariant_step(mod, [context + n], [n], [table], block,
                                                       [parents] if parents else None)
                        for _ in range(layers):
                            outs[name] = backend(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)
                        times[name].append(time.perf_counter() - start)
            if args.check and not torch.equal(outs["base"], outs["this"]):
                raise SystemExit(f"attention_ab: outputs differ ({case}, context {context})")
            best = {name: min(t[1:]) for name, t in times.items()}
            cells = "".join(f"{1e3 * best[name]:>11.2f}{1e3 * statistics.median(t[1:]):>11.2f}"
                            for name, t in times.items())
            print(f"{context:>8} {case:<8}{cells}{best['this'] / best['base']:>11.2f}")


if __name__ == "__main__":
    main()
