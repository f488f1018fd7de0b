"""The `kvsparse` command: the engine's subcommands plus serving (`serve`, `bench serve`)."""

from __future__ import annotations

import argparse
import sys

from service import bench_serve, serve
from sparse_core import cli as engine_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsparse", description="LLM serving with layer-wise KV-cache sparsity"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    bench = engine_cli.add_subcommands(sub)
    if bench is None:  # an engine CLI without benchmarks of its own
        bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
            dest="bench", required=True
        )
    serve_parser = sub.add_parser("serve", help="OpenAI-compatible server (standalone or --ray)")
    serve.add_serve_args(serve_parser)
    serve_parser.set_defaults(func=serve.cmd_serve)
    bench_serve.add_arguments(
        bench.add_parser("serve", help="load an OpenAI-compatible server at several concurrencies")
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    return engine_cli.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
