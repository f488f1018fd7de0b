"""The host's share of a load, without a model: `python -m sparse_core.bench.host_steps`.

Runs `kvsparse bench throughput`'s load (`--num-prompts` prompts of `--input-len` tokens, the
first `--shared-prefix-len` of them shared, `--output-len` tokens each) through the engine's own
scheduler, block manager and batch builder at a preset model's shape, with every sampled token
a constant: what the host does to schedule each step and describe it to the device, and nothing
the device does. Prints the host milliseconds per step that prefills and per decode-only step,
the prefix cache's hits, and (`--profile N`) the N functions with the most cumulative time.

On a GPU the host prepares a step while the device runs the one before (async scheduling), so
host time beyond a step's device time is what it costs; a change to the host path can be judged
here on any machine, then confirmed with `kvsparse bench throughput` on the GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from sparse_core.bench.workload import bench_prompts
from sparse_core.cache.block_manager import BlockManager
from sparse_core.cache.retention import KVRetention
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.batch_builder import BatchBuilder
from sparse_core.engine.scheduler import Scheduler
from sparse_core.models.config import DUMMY_PRESETS
from sparse_core.sampling_params import SamplingParams
from sparse_core.sequence import Sequence

SAMPLED_TOKEN = 7


def run_load(args: argparse.Namespace) -> tuple[dict[str, list[float]], BlockManager]:
    """Step the load to its end; the host seconds of each step, by kind, and the blocks."""
    config = EngineConfig(
        block_size=args.block_size,
        kv_cache_dtype="fp8",
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.max_num_seqs,
        expected_input_len=args.input_len,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        device="cpu",
    )
    sparsity = SparsityConfig(policy="snapkv", budget=args.budget, window=32, full_layers=3)
    retention = KVRetention.build(DUMMY_PRESETS[args.preset], config, sparsity, torch.bfloat16)
    blocks = BlockManager(
        retention,
        retention.num_blocks(int(args.kv_cache_memory_gb * 2**30)),
        config.max_num_seqs,
        config.max_model_len,
        config.enable_prefix_caching,
        sparsity.window,
    )
    scheduler = Scheduler(config, blocks, sparsity.window)
    builder = BatchBuilder(retention)
    vocab = DUMMY_PRESETS[args.preset].vocab_size
    prompts = bench_prompts(
        random.Random(0), vocab, args.num_prompts, args.input_len, args.shared_prefix_len
    )
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add(Sequence(str(i), prompt, params, len(retention.groups)))
    seconds: dict[str, list[float]] = {"prefill": [], "decode": []}
    while scheduler.has_work:
        start = time.perf_counter()
        step = scheduler.schedule()
        if not step:
            raise RuntimeError("the load cannot run: a step scheduled nothing")
        wanted = [seq.samples_next_token for seq in step.seqs]
        builder.build(step, blocks)
        scheduler.step_done(step)
        for seq, sampled in zip(step.seqs, wanted, strict=True):
            if sampled:
                seq.output_token_ids.append(SAMPLED_TOKEN)
                if len(seq.output_token_ids) >= args.output_len:
                    scheduler.finish(seq, "length")
        seconds["prefill" if step.prefills else "decode"].append(time.perf_counter() - start)
    blocks.check_invariants([])
    return seconds, blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(DUMMY_PRESETS))
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=500)
    parser.add_argument("--shared-prefix-len", type=int, default=0)
    parser.add_argument("--no-enable-prefix-caching", action="store_true")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=128, help="the CUDA default")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=11.64,
        help="the KV cache the 8B shape gets under the 24 GB cap with FP8 weights",
    )
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the engine's host work is single-threaded
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    seconds, blocks = run_load(args)
    if profiler is not None:
        profiler.disable()
    for kind, times in seconds.items():
        mean = 1000 * sum(times) / len(times) if times else 0.0
        print(f"{kind} steps: {len(times)}, host {mean:.1f} ms each, {sum(times):.2f} s in all")
    queries = blocks.prefix_cache_queries
    print(f"prefix cache: {blocks.prefix_cache_hits} of {queries} prefill tokens found")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
