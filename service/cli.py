"""The `kvsparse` command: the engine's subcommands and benchmarks plus `serve`."""

from __future__ import annotations

import argparse
import sys

from service import serve
from sparse_core import cli as engine_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsparse", description="LLM serving with layer-wise KV-cache sparsity"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    engine_cli.add_subcommands(sub)
    serve_parser = sub.add_parser("serve", help="OpenAI-compatible server (standalone or --ray)")
    serve.add_serve_args(serve_parser)
    serve_parser.set_defaults(func=serve.cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    return engine_cli.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
