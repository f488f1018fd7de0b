"""The `kvsparse` command: the engine's subcommands plus serving."""

from __future__ import annotations

import argparse
import sys

from sparse_core import cli as engine_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsparse", description="LLM serving with layer-wise KV-cache sparsity"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    engine_cli.add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return engine_cli.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
