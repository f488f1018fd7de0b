"""`kvsparse` command line: `kvsparse generate PROMPT ...` (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from sparse_core.engine_args import add_config_args, configs_from_args
from sparse_core.eval.cli import add_eval_subcommands


def cmd_generate(args: argparse.Namespace) -> int:
    from sparse_core.engine.llm_engine import LLMEngine
    from sparse_core.sampling_params import SamplingParams

    engine_config, sparsity = configs_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    start = time.monotonic()
    engine = LLMEngine(engine_config, sparsity)
    print(
        f"[loaded {engine.model_config.name} in {time.monotonic() - start:.1f}s]", file=sys.stderr
    )
    prompt: str | list[int] = args.prompt
    if not args.raw and engine.tokenizer.has_chat_template:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    seq = engine.make_sequence("cli-0", prompt, params)
    engine.add_sequence(seq)
    printed = 0
    start = time.monotonic()
    while engine.has_unfinished:
        for out in engine.step():
            sys.stdout.write(out.text[printed:])
            sys.stdout.flush()
            printed = len(out.text)
            final = out
    elapsed = time.monotonic() - start
    print()
    summary = {
        "prompt_tokens": len(final.prompt_token_ids),
        "completion_tokens": len(final.token_ids),
        "finish_reason": final.finish_reason,
        "kv_tokens_per_group": final.kv_tokens_per_group,
        "kv_tokens_held": final.kv_tokens_held,
        "compression_ratio": round(final.compression_ratio, 2),
        "seconds": round(elapsed, 2),
    }
    print(json.dumps(summary), file=sys.stderr)
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from sparse_core.bench import throughput

    return throughput.main(args)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """The engine's subcommands and the benchmarks; the `kvsparse` entry point (service.cli)
    adds `serve`."""
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_config_args(gen)  # every engine and sparsity flag
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    tp = bench.add_parser("throughput", help="offline throughput, policies side by side (GPU)")
    from sparse_core.bench.throughput import add_arguments  # imports torch

    add_arguments(tp)
    tp.set_defaults(func=cmd_bench_throughput)
    from sparse_core.bench import serve

    serve.add_arguments(
        bench.add_parser("serve", help="load an OpenAI-compatible server at several concurrencies")
    )
    add_eval_subcommands(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsparse", description=__doc__)
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse and dispatch; a ValueError (bad flag value, bad model...) exits 2 with its message."""
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.exit(2, f"kvsparse: error: {exc}\n")


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
