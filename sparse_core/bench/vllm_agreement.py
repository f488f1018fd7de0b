"""Greedy tokens of vLLM with kvsparse's plugin, against stock vLLM and against kvsparse's own
engine, on a real model.

    python -m sparse_core.bench.vllm_agreement [--model smollm2-135m-instruct] [--length 2000]
        [--num-prompts 16] [--max-tokens 64] [--dtype bfloat16] [--policy snapkv]
        [--budget 256] [--window 32] [--full-layers 3] [--gpu-memory-utilization 0.2]
        [--enforce-eager] [--block-size N] [--json OUT.json]

Prompts are accuracy-suite samples (passkey and single-needle tasks) of `--length` tokens, fed
as token ids. Six runs, greedy with `ignore_eos`: stock vLLM; the plugin dense (it then stays out
of vLLM's way, so this checks that it does); the plugin with the sparse policy's whole layers and
the others at a budget no prompt reaches (its kernels on every layer, nothing compressed); the plugin with the
sparse policy; kvsparse's engine with the same policy and dense. Pairs: plugin dense vs stock
vLLM (identical by construction), plugin uncompressed vs stock vLLM (the plugin's kernels
against vLLM's), plugin sparse vs kvsparse sparse (the same selection inside vLLM), kvsparse
dense vs stock vLLM (how far two engines' kernels alone drift apart in this dtype), and plugin
sparse vs plugin uncompressed (what the sparsity changes). Per pair: prompts whose outputs are
identical, and the mean share of each output that agrees before the first different token.
Needs vLLM importable (docs/vllm_plugin.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

from sparse_core.bench.workload import sparsity_for
from sparse_core.config import SparsityConfig
from sparse_core.eval.tasks import TaskBuilder

TASKS = ("passkey", "niah_single_noise", "niah_single_english")


@dataclass(frozen=True)
class Agreement:
    identical: int  # prompts whose outputs are the same tokens
    prompts: int
    prefix_share: float  # mean share of an output before its first different token

    @classmethod
    def of(cls, a: list[list[int]], b: list[list[int]]) -> Agreement:
        if len(a) != len(b) or not a:
            raise ValueError(f"two runs over the same prompts, not {len(a)} and {len(b)}")
        pairs = list(zip(a, b, strict=True))
        shares = [_agreeing_prefix(x, y) / max(len(x), len(y), 1) for x, y in pairs]
        return cls(sum(x == y for x, y in pairs), len(pairs), sum(shares) / len(shares))


def _agreeing_prefix(x: list[int], y: list[int]) -> int:
    """Tokens before the first position where x and y differ (or one ends)."""
    n = min(len(x), len(y))
    return next((i for i in range(n) if x[i] != y[i]), n)


def prompts_of(model: str, length: int, count: int) -> list[list[int]]:
    from sparse_core.models.loader import load_model_source

    builder = TaskBuilder(load_model_source(model).tokenizer, seed=1)
    per_task = -(-count // len(TASKS))
    samples = [s for task in TASKS for s in builder.build(task, length, per_task)]
    return [s.prompt_ids for s in samples[:count]]


def run_vllm(args: argparse.Namespace, sparsity: SparsityConfig | None, prompts) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    from sparse_core.vllm_plugin.engine import vllm_llm

    engine_args = {
        "dtype": args.dtype,
        "max_model_len": args.length + args.max_tokens + 64,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
        **({"block_size": args.block_size} if args.block_size else {}),
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with vllm_llm(args.model, sparsity, args.length, **engine_args) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_native(args: argparse.Namespace, sparsity: SparsityConfig, prompts) -> list[list[int]]:
    from sparse_core import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(
        model=args.model,
        sparsity=sparsity,
        dtype=args.dtype,
        max_model_len=args.length + args.max_tokens + 64,
        enforce_eager=args.enforce_eager,
    ) as llm:
        return [out.token_ids for out in llm.generate(prompts, params)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--length", type=int, default=2000, help="prompt tokens")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policy", default="snapkv")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--full-layers", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--enforce-eager", action="store_true", help="both engines without graphs")
    p.add_argument("--block-size", type=int, default=None, help="vLLM's (default: its own)")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.policy == "dense":
        p.error("--policy: a sparse policy, compared against dense")
    sparse = sparsity_for(args.policy, args.budget, args.window, args.full_layers)
    # The sparse run's whole layers, snapkv's budget above every prompt: whatever the policy
    # (pyramid's deep layers take a fraction of the budget), no layer compresses.
    uncompressed = sparsity_for("snapkv", args.length + args.max_tokens, args.window,
                                args.full_layers)  # fmt: skip
    dense = SparsityConfig(policy="dense")
    prompts = prompts_of(args.model, args.length, args.num_prompts)
    runs = {
        "stock vLLM": run_vllm(args, None, prompts),
        "plugin dense": run_vllm(args, dense, prompts),
        "plugin uncompressed": run_vllm(args, uncompressed, prompts),
        f"plugin {args.policy}": run_vllm(args, sparse, prompts),
        f"kvsparse {args.policy}": run_native(args, sparse, prompts),
        "kvsparse dense": run_native(args, dense, prompts),
    }
    pairs = [
        ("plugin dense", "stock vLLM"),
        ("plugin uncompressed", "stock vLLM"),
        (f"plugin {args.policy}", f"kvsparse {args.policy}"),
        ("kvsparse dense", "stock vLLM"),
        (f"plugin {args.policy}", "plugin uncompressed"),
    ]
    rows: list[dict[str, Any]] = []
    print(f"{args.model}, {args.dtype}, {len(prompts)} prompts of {args.length} tokens, "
          f"{args.max_tokens} generated; {args.policy} budget {args.budget}, "
          f"{args.full_layers} layers whole")  # fmt: skip
    print("| pair | identical outputs | agreeing prefix |")
    print("|---|---|---|")
    for a, b in pairs:
        agree = Agreement.of(runs[a], runs[b])
        rows.append({"pair": f"{a} vs {b}", **asdict(agree)})
        print(f"| {a} vs {b} | {agree.identical} / {agree.prompts} | {agree.prefix_share:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "pairs": rows, "outputs": runs}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
