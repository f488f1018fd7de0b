"""Offline throughput: N random prompts of a fixed length in, a fixed number of tokens out.

`kvsparse bench throughput --model dummy:llama3-8b --policies dense,snapkv,pyramid
--gpu-memory-limit-gb 24` runs each policy in turn on the same GPU and prints one table; the
JSON (`--json`) keeps every figure, including decode-step times per batch size and their
fraction of the bandwidth roofline (docs/benchmarks.md, "Kernels and the decode roofline").
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from sparse_core.bench.workload import bench_prompts, calibrated_shape, random_prompt
from sparse_core.cache.retention import KVRetention
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.device import use_one_host_thread
from sparse_core.engine.gpu_memory import (
    gpu_memory_outside_torch,
    peak_process_gpu_bytes,
    process_gpu_bytes,
)
from sparse_core.engine.llm_engine import LLMEngine
from sparse_core.engine.step_log import StepRecord
from sparse_core.engine_args import Default, add_config_args, config_values
from sparse_core.outputs import RequestOutput
from sparse_core.sampling_params import SamplingParams


@dataclass
class RunResult:
    label: str
    num_prompts: int
    input_len: int
    output_len: int
    seconds: float
    output_tok_s: float
    total_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    peak_running: int
    num_preemptions: int
    # Of the prefill tokens admitted (the warm-up's included), those found in the prefix cache.
    prefix_cache_hit_rate: float
    kv_blocks: int  # the KV cache's blocks, shared by every layer group
    kv_cache_gib: float
    # The KV a sequence holds in all its layers when it finishes (the prompt's kept tokens and
    # every token fed after them, or with decode eviction what its sparse layers keep): the most
    # it holds after its prefill (a chunked prefill holds more while it runs). The median over
    # the run's sequences, counted in tokens (not blocks); tensor parallel: one rank's.
    kv_bytes_per_seq_held: int
    # The GPU memory at this process's peak: torch's allocator at its peak (CUDA graph pools
    # included) plus what the process holds outside it at the end of the run (the CUDA context;
    # sparse_core/engine/gpu_memory.py): the figure to hold against --gpu-memory-limit-gb. Tensor
    # parallel: rank 0's. None on CPU.
    peak_gpu_memory_gib: float | None
    prefill_s_per_4k_tokens: float  # steps with a prefill, their decode rows included
    # Wall time in steps with a prefill, in decode-only steps, and between steps (host work).
    time_split_s: dict[str, float] = field(default_factory=dict)
    # Of the time in steps, the host's until each step's forward pass was enqueued: where it
    # nears the step time, those steps are host-bound (on CPU the launch runs the step).
    launch_s: dict[str, float] = field(default_factory=dict)
    # Of the launching, first launches of kernel variants (compiled, or loaded from Triton's
    # cache) after the warm-up: stalls a warm server would not have.
    kernel_first_launch_s: float = 0.0
    # Where the peak comes from (GiB, on a GPU): the process once the engine was ready, torch's
    # allocator at its peak (reserved, and allocated within it), and the process's memory
    # outside the allocator at the end.
    gpu_memory_split_gib: dict[str, float] = field(default_factory=dict)
    decode_by_batch: list[dict] = field(default_factory=list)


def held_kv_bytes(output: RequestOutput, retention: KVRetention) -> int:
    """The KV cache a finished sequence held in all its layers (`kv_tokens_held`)."""
    token_layers = retention.layer_plan.token_layers(output.kv_tokens_held)
    return token_layers * retention.bytes_per_token_per_layer


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second: the decode roofline."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    seconds, copied = time.perf_counter() - start, 2 * src.numel() * 10
    del src, dst
    torch.cuda.empty_cache()  # or the engines' peak memory would count these 4 GiB
    return copied / seconds


def decode_table(
    records: list[StepRecord], weight_bytes: int, kv_bytes_per_token_layer: int, bandwidth: float
) -> list[dict]:
    """Median decode-step time per batch size and the bandwidth it achieves."""
    by_batch: dict[int, list[StepRecord]] = {}
    for r in records:
        if not r.is_prefill:
            by_batch.setdefault(r.num_decode_seqs, []).append(r)
    rows = []
    for batch in sorted(by_batch):
        steps = by_batch[batch]
        t = statistics.median(r.seconds for r in steps)
        kv = statistics.median(r.kv_token_layers for r in steps) * kv_bytes_per_token_layer
        achieved = (weight_bytes + kv) / t
        rows.append(
            {
                "batch": batch,
                "steps": len(steps),
                "step_ms": round(t * 1e3, 3),
                "tok_s": round(batch / t, 1),
                "bytes_gb": round((weight_bytes + kv) / 1e9, 3),
                "roofline_fraction": round(achieved / bandwidth, 3) if bandwidth else None,
            }
        )
    return rows


def run_one(
    label: str,
    engine_config: EngineConfig,
    sparsity: SparsityConfig,
    num_prompts: int,
    input_len: int,
    output_len: int,
    bandwidth: float,
    shared_prefix_len: int = 0,
    seed: int = 0,
) -> RunResult:
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()  # the previous policy's engine is gone
    engine = LLMEngine(engine_config, sparsity)
    ready_bytes = process_gpu_bytes(engine.runner.device) if on_gpu else None
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompts = bench_prompts(rng, vocab, num_prompts, input_len, shared_prefix_len)
    # Warm-up: one short request of its own (it shares nothing with the prompts) compiles the
    # prefill and sampling paths.
    warmup = random_prompt(rng, vocab, min(256, input_len))
    engine.add_request("warmup", warmup, SamplingParams(max_tokens=4))
    while engine.has_unfinished:
        engine.step()
    engine.step_records = []
    start = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished, peak = [], 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                out.finish_time = time.monotonic()
                finished.append(out)
        peak = max(peak, len(engine.scheduler.running))
    elapsed = time.monotonic() - start
    ttft = [o.first_token_time - start for o in finished]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in finished]
    runner = engine.runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    prefill = [r for r in engine.step_records if r.is_prefill]
    decode = [r for r in engine.step_records if not r.is_prefill]
    prefill_s = sum(r.seconds for r in prefill)
    decode_s = sum(r.seconds for r in decode)
    stats = engine.stats()
    peak_memory, memory_split = None, {}
    if on_gpu:
        peak_memory = peak_process_gpu_bytes(runner.device)
        split = {
            "ready": ready_bytes,
            "allocator_reserved_peak": torch.cuda.max_memory_reserved(runner.device),
            "allocator_allocated_peak": torch.cuda.max_memory_allocated(runner.device),
            "outside_allocator": gpu_memory_outside_torch(runner.device),
        }
        memory_split = {k: round(v / 2**30, 2) for k, v in split.items() if v is not None}
    result = RunResult(
        label=label,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        seconds=round(elapsed, 2),
        output_tok_s=round(num_prompts * output_len / elapsed, 1),
        total_tok_s=round(num_prompts * (input_len + output_len) / elapsed, 1),
        ttft_p50_s=round(percentile(ttft, 0.5), 3),
        ttft_p99_s=round(percentile(ttft, 0.99), 3),
        tpot_p50_s=round(percentile(tpot, 0.5), 4),
        peak_running=peak,
        num_preemptions=stats.num_preemptions,
        prefix_cache_hit_rate=round(stats.prefix_cache_hits / stats.prefix_cache_queries, 3)
        if stats.prefix_cache_queries
        else 0.0,
        kv_blocks=engine.block_manager.pool.num_blocks,
        kv_cache_gib=round(
            engine.block_manager.pool.num_blocks * engine.retention.block_bytes / 2**30, 2
        ),
        kv_bytes_per_seq_held=int(
            statistics.median(held_kv_bytes(o, engine.retention) for o in finished)
        ),
        peak_gpu_memory_gib=None if peak_memory is None else round(peak_memory / 2**30, 2),
        prefill_s_per_4k_tokens=round(
            4000 * prefill_s / max(1, sum(r.num_prefill_tokens for r in prefill)), 4
        ),
        time_split_s={
            "prefill_steps": round(prefill_s, 2),
            "decode_steps": round(decode_s, 2),
            "between_steps": round(elapsed - prefill_s - decode_s, 2),
        },
        launch_s={
            "prefill_steps": round(sum(r.launch_seconds for r in prefill), 2),
            "decode_steps": round(sum(r.launch_seconds for r in decode), 2),
        },
        gpu_memory_split_gib=memory_split,
        kernel_first_launch_s=round(
            sum(r.kernel_first_launch_seconds for r in engine.step_records), 3
        ),
        decode_by_batch=decode_table(
            engine.step_records, weights, engine.retention.bytes_per_token_per_layer, bandwidth
        ),
    )
    engine.shutdown()  # tensor-parallel workers: the next policy starts its own
    del engine, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def print_table(results: list[RunResult]) -> None:
    head = (
        f"{'run':<22}{'out tok/s':>10}{'total tok/s':>12}{'TTFT p50':>9}{'TTFT p99':>9}"
        f"{'TPOT p50':>9}{'peak seqs':>10}{'cached':>11}{'KV GiB':>7}{'KV MiB/seq':>11}"
        f"{'peak GiB':>9}{'prefill/4k':>11}"
        f"{'s in prefill/decode/between steps':>36}{'launching prefill/decode':>26}"
    )
    print(head)
    for r in results:
        peak = "-" if r.peak_gpu_memory_gib is None else f"{r.peak_gpu_memory_gib:.2f}"
        print(
            f"{r.label:<22}{r.output_tok_s:>10.0f}{r.total_tok_s:>12.0f}{r.ttft_p50_s:>9.2f}"
            f"{r.ttft_p99_s:>9.2f}{r.tpot_p50_s * 1e3:>8.1f}m{r.peak_running:>10}"
            f"{r.prefix_cache_hit_rate:>11.0%}"
            f"{r.kv_cache_gib:>7.1f}{r.kv_bytes_per_seq_held / 2**20:>11.1f}{peak:>9}"
            f"{r.prefill_s_per_4k_tokens * 1e3:>10.0f}m"
            f"{'/'.join(f'{t:.1f}' for t in r.time_split_s.values()):>36}"
            f"{'/'.join(f'{t:.1f}' for t in r.launch_s.values()):>26}"
        )


# `bench throughput`'s own defaults: the 4000-in / 500-out benchmarks of docs/benchmarks.md
# ("Setup") on a random-weight Llama-3-8B.
BENCH_DEFAULTS = {
    "model": "dummy:llama3-8b",
    "max_num_seqs": 256,
    "max_model_len": 4608,
    "full_layers": 3,
    "expected_input_len": Default(None, "--input-len"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policies",
        default="dense,snapkv,pyramid",
        help="comma-separated: one run each, on the sparsity flags (dense: none of them apply)",
    )
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=500)
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="prompt tokens every prompt shares at its start (the prefix cache's workload)",
    )
    parser.add_argument(
        "--profile-model",
        default="smollm2-135m-instruct",
        help="with --layer-budgets auto: whose calibrated profile gives the budgets' shape, laid "
        "onto --model's layers by relative depth",
    )
    parser.add_argument("--json", default=None, help="write all results here")
    add_config_args(parser, BENCH_DEFAULTS, exclude=("policy",))


def run_configs(args: argparse.Namespace) -> list[tuple[str, EngineConfig, SparsityConfig]]:
    """Each run's label, engine and sparsity: one per --policies entry. Layer budgets replace
    --budget and --full-layers; `auto` lays --profile-model's calibrated shape onto --model."""
    engine_values = config_values(args, EngineConfig)
    engine_values.setdefault("expected_input_len", args.input_len)
    config = EngineConfig(**engine_values)
    values = config_values(args, SparsityConfig)
    cap = f"cap {args.gpu_memory_limit_gb:g}G" if args.gpu_memory_limit_gb else "uncapped"
    weights = f" w-{config.quantization}" if config.quantization else ""
    kv = f" kv-{config.kv_cache_dtype}" if config.fp8_kv_cache else ""
    runs = []
    for policy in args.policies.split(","):
        if policy == "dense":
            runs.append((f"dense{weights}{kv} {cap}", config, SparsityConfig(policy="dense")))
            continue
        run = {**values, "policy": policy}
        label = f"{policy} {run['full_layers']} full"
        if run["layer_budgets"] == "auto":
            if run["target_compression"] is None:
                raise ValueError("--layer-budgets auto needs --target-compression (e.g. 4)")
            run["layer_budgets"] = calibrated_shape(
                args.profile_model,
                run["target_compression"],
                config.model,
                args.input_len,
                run["window"],
                run["sinks"],
            )
            label = f"{policy} budgets@{run['target_compression']:g}x"
            run["target_compression"] = None  # the budgets have it
        elif run["layer_budgets"] is not None:
            label = f"{policy} budgets"
        if run["layer_budgets"] is not None:
            run["full_layers"] = None
        if run["decode_eviction"]:
            label += f" evict@{run['decode_window']}"
        runs.append((f"{label}{weights}{kv} {cap}", config, SparsityConfig(**run)))
    return runs


def main(args: argparse.Namespace) -> int:
    runs = run_configs(args)  # checks the flags before anything runs
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        use_one_host_thread()  # as the server's engine process does
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    # No roofline on CPU: the run is then only a smoke test of the benchmark itself.
    bandwidth = measure_copy_bandwidth(torch.device("cuda")) if on_gpu else 0.0
    print(f"device {device_name}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr)
    results = []
    for label, config, sparsity in runs:
        result = run_one(
            label,
            config,
            sparsity,
            args.num_prompts,
            args.input_len,
            args.output_len,
            bandwidth,
            args.shared_prefix_len,
        )
        results.append(result)
        print(json.dumps(asdict(result)), file=sys.stderr, flush=True)
        if args.json:  # rewritten after every run, so a run cut short keeps what finished
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "device": device_name,
                        "copy_bandwidth": bandwidth,
                        "results": [asdict(r) for r in results],
                    },
                    f,
                    indent=1,
                )
    print_table(results)
    return 0
