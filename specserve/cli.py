"""`specserve` command line: serve, generate, train-draft, bench {offline,serve,spec,load,gpu}.

Subcommands import their modules lazily so `specserve --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_BENCHES = {
    "offline": ("specserve.bench.offline", "offline throughput: specserve vs transformers generate()"),
    "serve": ("specserve.bench.serving", "latency and throughput of a running server"),
    "spec": ("specserve.bench.spec", "speculative decoding over the Spec-Bench prompts"),
    "load": ("specserve.bench.load", "plain decoding vs speculation at concurrency 1..64 (chat + code)"),
    "gpu": ("specserve.bench.gpu", "the GPU measurements in one run: kernel tests and sweep, 8B-shaped "
            "decode eager vs graphs, step profile, greedy equality, the real model"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    from specserve.server.cli import add_serve_args

    add_serve_args(sub.add_parser("serve", help="run the OpenAI-compatible server"))

    gen = sub.add_parser("generate", help="generate a completion offline and print it")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--speculative-config", default="auto")
    gen.add_argument("--enforce-eager", action="store_true", help="no compiled step, no CUDA graphs")
    gen.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="split the model across N ranks (specserve serve --help)")

    from specserve.spec_decode.training import train

    train.add_args(sub.add_parser("train-draft", help="train an EAGLE or Medusa draft head "
                                  "for a target model (self-distillation)"))

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in _BENCHES.items():
        p = bench.add_parser(name, help=help_text)
        try:
            importlib.import_module(module).add_args(p)
        except ImportError as e:  # a benchmark whose module is missing stays listed
            p.set_defaults(_missing=str(e))
    return parser


def _generate(args: argparse.Namespace) -> int:
    from specserve import LLM, SamplingParams

    llm = LLM(args.model, speculative_config=args.speculative_config, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            from specserve.server.cli import run_server

            return run_server(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "train-draft":
            from specserve.spec_decode.training import train

            train.run(args)
            return 0
        if getattr(args, "_missing", None):
            print(f"specserve bench {args.bench}: unavailable ({args._missing})", file=sys.stderr)
            return 2
        rc = importlib.import_module(_BENCHES[args.bench][0]).run(args)
        return rc if isinstance(rc, int) else 0  # some benches return their result dict
    except ValueError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
