"""Stock vLLM beside the same vLLM with kvsparse's plugin: offline throughput at one memory budget,
with vLLM's own KV accounting while the sequences run.

    python -m sparse_core.bench.vllm_plugin [--engines stock,plugin] [--model dummy:llama3-8b]
        [--gpu-memory-utilization 0.17] [--num-prompts 128] [--input-len 4000]
        [--output-len 500] [--shared-prefix-len 0] [--policy snapkv --budget 512 --full-layers 3]
        [--engine-arg KEY=VALUE ...] [--plugin-arg KEY=VALUE ...] [--engine-in-process]
        [--json OUT.json]

Each engine runs in a process of its own (vLLM picks its attention backend once per process), on
the same random prompts (token ids), greedy, `ignore_eos`. Per engine: output tokens/s from the
first request to the last token, the median time of a step that started no request (a step of
decodes only, as the engine's loop sees it), vLLM's KV cache in blocks (with the plugin, vLLM
lays layers out as several KV cache groups, and each block holds block_size tokens of one
group's layers, so blocks are not tokens of the whole model), the most sequences running at
once, vLLM's free blocks then, preemptions, and on a GPU the most device memory the engine's
processes held at once (`gpu_watch`, CUDA contexts and graph pools included). The defaults are
the GPU benchmarks' shape (docs/benchmarks.md, "Setup"): gpu_memory_utilization 0.17 is 24 GB of
an H200, as in stock vLLM's own benchmark there. Needs vLLM importable (docs/vllm_plugin.md).

`--engine-in-process` runs vLLM's engine core inside each engine's process instead of a process
of its own (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so that on a GPU the run also reports torch's
peak allocated and reserved memory: the difference is what the caching allocator held beyond
the tensors alive at once. The host side is slower that way; use it to see where memory goes,
not for speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from sparse_core.bench.gpu_watch import GIB, DeviceMemoryWatch, nvml_available
from sparse_core.bench.workload import bench_prompts, sparsity_for
from sparse_core.config import SparsityConfig
from sparse_core.models.loader import load_model_source

ENGINES = ("stock", "plugin")
# Seconds an engine's processes have to stop once asked (SIGTERM) before they are killed.
STOP_GRACE_S = 5
# Metrics are read every this many engine steps: often enough to see the most sequences running
# (it changes as requests finish), rarely enough not to slow the steps measured. The first read
# comes after the first prompts' gap blocks are freed (the step after their prefill); a run of
# fewer steps reports none.
SAMPLE_EVERY = 8


def engine_arg(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value read as JSON where it parses (numbers, true/false), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"a vLLM engine argument is KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """One engine (`args.only`) in this process: the run's figures."""
    from vllm import SamplingParams, TokensPrompt

    from sparse_core.vllm_plugin.engine import vllm_llm
    from sparse_core.vllm_plugin.stats import free_blocks, vllm_metrics

    plugin = args.only == "plugin"
    sparsity = sparsity_for(args.policy, args.budget, args.window, args.full_layers)
    vocab = load_model_source(args.model).config.vocab_size
    rng = random.Random(args.seed)
    prompts = bench_prompts(rng, vocab, args.num_prompts, args.input_len, args.shared_prefix_len)
    engine_args = {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.input_len + args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "disable_log_stats": False,
        **dict(args.engine_arg),
        **(dict(args.plugin_arg) if plugin else {}),
    }
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with vllm_llm(args.model, sparsity if plugin else None, args.input_len, **engine_args) as llm:
        engine = llm.llm_engine
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
        output_tokens, steps, most_running, free_then = 0, 0, 0, None
        decode_steps: list[float] = []  # seconds of each step that started no request
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            started = False
            for out in outputs:
                generated = len(out.outputs[0].token_ids)
                started = started or generated == 1
                if out.finished:
                    output_tokens += generated
            if outputs and not started:
                decode_steps.append(time.perf_counter() - step_start)
            steps += 1
            if steps % SAMPLE_EVERY == 0:
                metrics = vllm_metrics(llm)
                running = int(metrics["vllm:num_requests_running"].value)
                if running > most_running:
                    most_running, free_then = running, free_blocks(metrics)
        wall = time.perf_counter() - start
        metrics = vllm_metrics(llm)
        cache = metrics["vllm:cache_config_info"].labels
    blocks, block_size = int(cache["num_gpu_blocks"]), int(cache["block_size"])
    return {
        "engine": "vLLM + kvsparse plugin" if plugin else "stock vLLM",
        "sparsity": describe(sparsity) if plugin else "none",
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "wall_s": round(wall, 2),
        "output_tokens": output_tokens,
        "output_tok_per_s": round(output_tokens / wall, 1),
        "steps": steps,
        "decode_step_ms_median": round(1000 * statistics.median(decode_steps), 2)
        if decode_steps
        else None,
        "kv_blocks": blocks,
        "block_size": block_size,
        "most_running": most_running,
        "free_blocks_at_most_running": free_then,
        "preemptions": int(metrics["vllm:num_preemptions"].value),
        **(torch_memory_peaks() if args.engine_in_process else {}),
    }


def torch_memory_peaks() -> dict[str, float]:
    """torch's peak allocated and reserved device memory in this process, on a GPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {
        "torch_allocated_peak_gib": round(stats["allocated_bytes.all.peak"] / GIB, 2),
        "torch_reserved_peak_gib": round(stats["reserved_bytes.all.peak"] / GIB, 2),
    }


def describe(sparsity: SparsityConfig) -> str:
    if not sparsity.compresses:
        return sparsity.policy
    return f"{sparsity.policy}, budget {sparsity.budget}, {sparsity.full_layers} layers whole"


def run_in_child(engine: str, argv: list[str], in_process: bool) -> dict[str, Any]:
    """`run_engine` for `engine` in a child process; its result, or why it failed. On a GPU
    that NVML sees, with the most device memory the child's processes held at once.
    `in_process`: vLLM's engine core runs in the child itself."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "sparse_core.bench.vllm_plugin", *argv]
        watch = DeviceMemoryWatch() if nvml_available() else None
        with watch or contextlib.nullcontext():
            returncode = run_process_group([*cmd, "--only", engine, "--json", out], env)
        if returncode != 0:
            return {"engine": engine, "error": f"exited with status {returncode}"}
        with open(out) as f:
            result = json.load(f)
    if watch is not None:
        result["gpu_memory_peak_gib"] = watch.report()["gpu_memory_peak_gib"]
    return result


def run_process_group(cmd: list[str], env: dict[str, str] | None) -> int:
    """Run `cmd` in a process group of its own and wait for it; if this process is stopped
    meanwhile (Ctrl-C, or a signal that `exit_on_termination` turns into an exit), the whole
    group goes with it: vLLM's engine core is a process of the child's, and left behind it
    would hold its GPU memory. The group is asked to stop (SIGTERM) and killed
    `STOP_GRACE_S` later, also after a normal exit (a process of the child's that outlived it)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def exit_on_termination() -> None:
    """SIGTERM (`timeout`, `kill`) and SIGHUP (the terminal closed) end this process as an
    exception does, running cleanups."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: sys.exit(128 + signum))


def without_json(argv: list[str]) -> list[str]:
    """`argv` less its --json option (each child writes its own)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif not arg.startswith("--json="):
            out.append(arg)
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    print(
        "| engine | output tok/s | KV blocks | most running | free blocks then | preemptions "
        "| decode step, median | GPU memory peak |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['engine']} | {r['error']} | | | | | | |")
            continue
        peak = r.get("gpu_memory_peak_gib")
        memory = "" if peak is None else f"{peak} GiB"
        if "torch_reserved_peak_gib" in r:
            memory += (
                f" (torch: {r['torch_allocated_peak_gib']} allocated, "
                f"{r['torch_reserved_peak_gib']} reserved)"
            )
        print(
            f"| {r['engine']} | {r['output_tok_per_s']:,.0f} | {r['kv_blocks']:,} | "
            f"{r['most_running']} | {r['free_blocks_at_most_running']} | {r['preemptions']} "
            f"| {r['decode_step_ms_median']} ms | {memory} |"
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES), help="stock, plugin or both")
    p.add_argument("--only", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="dummy:llama3-8b")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.17)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=4000)
    p.add_argument("--output-len", type=int, default=500)
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="prompt tokens every prompt shares at its start (with --engine-arg "
        "enable_prefix_caching=true: vLLM's prefix cache)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--policy", default="snapkv", help="the plugin's policy")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--full-layers", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    p.add_argument(
        "--engine-arg",
        type=engine_arg,
        action="append",
        default=[],
        help="a vLLM engine argument for both engines, KEY=VALUE (e.g. enforce_eager=true)",
    )
    p.add_argument(
        "--plugin-arg",
        type=engine_arg,
        action="append",
        default=[],
        help="a vLLM engine argument for the plugin's engine only, KEY=VALUE",
    )
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        help="vLLM's engine core in each engine's process: torch's peak allocated and reserved "
        "memory reported too (on a GPU); slower host side",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.only:
        result = run_engine(args)
        with open(args.json, "w") as f:
            json.dump(result, f)
        return 0
    exit_on_termination()
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        print(f"--engines takes {' and/or '.join(ENGINES)}, got {args.engines!r}", file=sys.stderr)
        return 2
    results = [
        run_in_child(engine, without_json(argv), args.engine_in_process) for engine in engines
    ]
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
