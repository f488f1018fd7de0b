"""`kvsparse` command line: `kvsparse generate PROMPT ...` (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from sparse_core.config import (
    KV_CACHE_DTYPES,
    POLICIES,
    POOLINGS,
    QUANTIZATIONS,
    EngineConfig,
    SparsityConfig,
)
from sparse_core.policy import has_profile


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine and sparsity flags, named as vLLM names them where vLLM has them."""
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="built-in alias, HF directory, .gguf file or dummy:<preset>",
    )
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-model-len", type=int, default=8192)
    add_step_size_args(engine)
    engine.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV cache page (default: 128 on CUDA, where the decode kernel reads a "
        "page per key tile; 16 elsewhere)",
    )
    engine.add_argument("--kv-cache-memory-gb", type=float, default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument(
        "--gpu-memory-limit-gb",
        type=float,
        default=None,
        help="hard cap on GPU memory, e.g. 24 to emulate an RTX 4090",
    )
    add_graph_args(engine)
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each step before the previous one's tokens reach the host, when it needs "
        "nothing else from them (default: on CUDA devices)",
    )
    engine.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="GPUs (processes on CPU) that split every layer's heads; KV heads must divide by it",
    )
    engine.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if present)"
    )
    engine.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    engine.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="fp8: linear layers' weights in FP8 e4m3 (per-channel scales, quantized at load), "
        "activations per token (needs compute capability 8.9+, e.g. RTX 4090, H100); a "
        "compressed-tensors FP8-Dynamic checkpoint sets it itself, loading its stored weights",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the KV cache in the model's dtype; fp8 (= fp8_e4m3): e4m3 pages, half the "
        "bytes of bf16, one K and one V scale per layer (needs compute capability 8.9+)",
    )
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument(
        "--step-log",
        default=None,
        metavar="PATH",
        help="append every engine step to PATH as a JSON line: a timeline of what ran and how "
        "long it took",
    )
    sparse = parser.add_argument_group("sparsity")
    sparse.add_argument("--policy", default="snapkv", choices=POLICIES)
    sparse.add_argument("--budget", type=int, default=512)
    sparse.add_argument("--window", type=int, default=32)
    sparse.add_argument("--sinks", type=int, default=4)
    sparse.add_argument(
        "--full-layers",
        default=None,
        help="first N layers, a comma-separated list of indices, or 'auto' (the model's "
        "calibrated profile); default: 'auto' when the model has a profile, else 3",
    )
    sparse.add_argument("--pooling", default="avg", choices=POOLINGS)
    sparse.add_argument("--kernel-size", type=int, default=7)
    add_layer_budget_args(sparse)


def add_layer_budget_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """A budget per layer instead of --budget and --full-layers."""
    parser.add_argument(
        "--layer-budgets",
        default=None,
        help="'auto' (the model's calibrated per-layer budgets for --target-compression) or one "
        "budget per layer, comma-separated, 'none' for a whole layer; replaces --budget and "
        "--full-layers",
    )
    parser.add_argument(
        "--target-compression",
        type=float,
        default=None,
        help="with --layer-budgets auto: the effective compression over all layers to pick the "
        "profile for (e.g. 4)",
    )


def parse_layer_budgets(text: str | None) -> str | list[int | None] | None:
    if text is None or text == "auto":
        return text
    try:
        return [None if x.strip().lower() == "none" else int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--layer-budgets must be 'auto' or comma-separated budgets ('none' for a whole "
            f"layer), got {text!r}"
        ) from None


def layer_budget_options(args: argparse.Namespace) -> dict:
    """SparsityConfig's layer_budgets, target_compression and full_layers from the flags: with
    layer budgets, full_layers stays unset unless given (which SparsityConfig then refuses)."""
    budgets = parse_layer_budgets(args.layer_budgets)
    full = args.full_layers
    return {
        "layer_budgets": budgets,
        "target_compression": args.target_compression,
        "full_layers": parse_full_layers(full, args.model) if budgets is None or full else None,
    }


def add_step_size_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """How many prompt tokens a step prefills, and whether a prompt may span several steps."""
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="prompt tokens prefilled per step; without chunked prefill prompts are whole, so "
        "at least --max-model-len (default: the larger of --max-model-len and 8192; for "
        "`kvsparse serve`, --max-model-len: one longest prompt per step)",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prefill a prompt that does not fit a step in chunks over several steps",
    )
    parser.add_argument(
        "--space-admissions",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="while sequences decode, follow a step that ended a prompt's prefill with one "
        "that admits no new prompt, so that a burst of requests does not finish in lockstep "
        "(default: off; on for `kvsparse serve`)",
    )


def add_graph_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Which steps replay CUDA graphs."""
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--max-prefill-graph-tokens",
        type=int,
        default=None,
        help="steps that prefill with up to this many tokens run all but their attention from "
        "CUDA graphs (default: with chunked prefill every step of up to 2048 prompt tokens; "
        "else 512; 0: never)",
    )


def parse_full_layers(text: str | None, model: str) -> int | list[int] | str:
    if text is None:
        return "auto" if has_profile(model) else 3
    if text == "auto":
        return "auto"
    try:
        if "," in text or text.startswith("["):
            return [int(x) for x in text.strip("[]").split(",") if x.strip()]
        return int(text)
    except ValueError:
        raise ValueError(
            f"--full-layers must be a number, a comma-separated list or 'auto', got {text!r}"
        ) from None


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, SparsityConfig]:
    engine = EngineConfig(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        space_admissions=bool(args.space_admissions),
        block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        gpu_memory_limit_gb=args.gpu_memory_limit_gb,
        enforce_eager=args.enforce_eager,
        max_prefill_graph_tokens=args.max_prefill_graph_tokens,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        step_log=args.step_log,
    )
    sparsity = SparsityConfig(
        policy=args.policy,
        budget=args.budget,
        window=args.window,
        sinks=args.sinks,
        pooling=args.pooling,
        kernel_size=args.kernel_size,
        **layer_budget_options(args),
    )
    return engine, sparsity


def cmd_generate(args: argparse.Namespace) -> int:
    from sparse_core.engine.llm_engine import LLMEngine
    from sparse_core.engine.sampling_params import SamplingParams

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
        "compression_ratio": round(final.compression_ratio, 2),
        "seconds": round(elapsed, 2),
    }
    print(json.dumps(summary), file=sys.stderr)
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from sparse_core.bench import throughput

    return throughput.main(args)


def add_subcommands(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The engine's subcommands; returns the `bench` group, where serving adds `bench serve`.

    The `kvsparse` entry point (service.cli) adds the serving subcommands."""
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    tp = bench.add_parser("throughput", help="offline throughput, policies side by side (GPU)")
    from sparse_core.bench.throughput import add_arguments

    add_arguments(tp)
    tp.set_defaults(func=cmd_bench_throughput)
    from sparse_core.eval.cli import add_eval_subcommands

    add_eval_subcommands(sub)
    return bench


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
