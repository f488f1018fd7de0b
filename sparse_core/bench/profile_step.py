"""Where a step's time goes: `python -m sparse_core.bench.profile_step` (CUDA only).

Prefills `--prompts` random prompts of `--input-len` tokens in one step (after `--running`
sequences were admitted, so that their decode rows join the step, as in a mixed step), times a
few such steps, then runs one under the torch profiler. Prints the step's wall time, the host's
time to launch it, when the GPU waited during it (before its first kernel, in gaps between
kernels, after its last), its GPU kernels by total time, and the torch ops and CUDA calls by host
time (Python's own time, Triton's launcher included, is the launch time those do not account
for).
With `--context N` the prompt is N tokens longer and prefilled in chunks: the measured step is
its last chunk, after N cached tokens. A prefill's matmuls are 2 FLOPs per token per weight of
the decoder layers; the printed roofline line compares the matmul kernels' time with that count
at `--peak-tflops`. With `--prompts 0` the measured step only decodes the running sequences
(a CUDA graph replay unless `--enforce-eager`); the roofline line then compares the kernels' time
with the bytes of the weights read once at `--bandwidth-tbs` (KV reads not counted).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from sparse_core.bench.workload import KEEP_DECODING, random_prompt, sparsity_for, start_decoding
from sparse_core.config import EngineConfig
from sparse_core.engine.llm_engine import LLMEngine
from sparse_core.engine_args import add_config_args

# Kernel-name fragments of the matmul libraries torch dispatches to on Hopper.
MATMUL_MARKERS = ("gemm", "nvjet", "sm90_xmma", "cutlass")
STEP_MARKER = "kvsparse.profiled_step"
CUDA = torch.autograd.DeviceType.CUDA
GAP_US = 20  # shorter gaps between kernels are the launch latency of queued kernels


@dataclass
class DeviceIdle:
    """Seconds in a profiled step when no kernel ran."""

    before_first: float
    between: float  # gaps over GAP_US
    longest: float
    after_last: float


def kernels(events) -> list:
    """The GPU's events: kernels and copies (the marker's GPU-side span left out)."""
    return [e for e in events if e.device_type == CUDA and e.name != STEP_MARKER]


def device_idle(events) -> DeviceIdle:
    """From the profiler's events: where the GPU waited during the step marked STEP_MARKER."""
    step = next(e for e in events if e.name == STEP_MARKER and e.device_type != CUDA)
    spans = sorted({(e.time_range.start, e.time_range.end) for e in kernels(events)})
    between = longest = 0.0
    busy_until = spans[0][1]
    for start, end in spans[1:]:
        gap = start - busy_until
        if gap > GAP_US:
            between += gap
            longest = max(longest, gap)
        busy_until = max(busy_until, end)
    return DeviceIdle(
        (spans[0][0] - step.time_range.start) / 1e6,
        between / 1e6,
        longest / 1e6,
        max(0.0, step.time_range.end - busy_until) / 1e6,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--policy", default="snapkv")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=4000)
    parser.add_argument("--running", type=int, default=0, help="sequences decoding alongside")
    parser.add_argument(
        "--context",
        type=int,
        default=0,
        help="cached tokens before the profiled chunk (with --prompts 1, a multiple of "
        "--input-len: the earlier chunks are --input-len tokens too)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (one more profiled)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=790.0,
        help="the matmuls' reachable peak (an H200's bf16 measured; FP8 about twice)",
    )
    parser.add_argument(
        "--bandwidth-tbs", type=float, default=4.26, help="copy bandwidth (an H200's measured)"
    )
    parser.add_argument("--top", type=int, default=20)
    add_config_args(
        parser,
        only=("enforce_eager", "max_prefill_graph_tokens", "quantization", "kv_cache_dtype"),
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    if args.prompts < 0 or (args.prompts == 0 and args.running < 1):
        parser.error("--prompts must be at least 0; a decode-only step (0) needs --running")
    if args.context and (args.prompts != 1 or args.context % args.input_len):
        parser.error("--context needs --prompts 1 and a multiple of --input-len")

    step_tokens = args.prompts * args.input_len
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_model_len=args.context + args.input_len + 608,
            # With a context, a step holds exactly the profiled chunk, so that the prompt's
            # first context tokens go in earlier steps, in chunks of the same size.
            max_num_batched_tokens=step_tokens if args.context else max(8192, step_tokens + 608),
            enable_chunked_prefill=args.context > 0,
            max_num_seqs=max(64, args.running + args.prompts),
            kv_cache_memory_gb=20,
            enforce_eager=args.enforce_eager,
            max_prefill_graph_tokens=args.max_prefill_graph_tokens,
            async_scheduling=False,  # one step at a time: nothing launched ahead of it
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        sparsity_for(args.policy),
    )
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    held = start_decoding(engine, args.running, args.input_len, rng)
    if held < args.running:
        parser.error(f"the KV cache holds only {held} of the --running sequences")

    def add(name: str, length: int) -> None:
        engine.add_request(name, random_prompt(rng, vocab, length), KEEP_DECODING)

    def admit(tag: str) -> list[str]:
        """Add the prompts; with a context, run its chunks (not measured)."""
        names = [f"{tag}-{i}" for i in range(args.prompts)]
        for name in names:
            add(name, args.context + args.input_len)
        while args.context and any(
            engine.sequences[name].num_computed_tokens < args.context for name in names
        ):
            engine.step()
        return names

    def measured_step(names: list[str]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with record_function(STEP_MARKER):  # the profiled step's span, for device_idle
            engine.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if any(engine.sequences[name].is_prefilling for name in names):
            parser.error("the prompts were not all prefilled: the KV cache is full")
        for name in names:
            engine.abort(name)
        return seconds

    measured_step(admit("warmup"))
    # Timed without the profiler (it slows the host): wall time, and the host's launch time.
    walls, launches = [], []
    for r in range(args.repeats):
        names = admit(f"timed{r}")
        engine.step_records = []
        walls.append(measured_step(names))
        launches.append(engine.step_records[-1].launch_seconds)
    engine.step_records = None
    names = admit("profiled")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        measured_step(names)

    per_kernel: dict[str, float] = defaultdict(float)  # ms in the step
    num_kernels = 0  # launches: the launch time over this is the host's cost per launch
    for event in kernels(prof.events()):
        per_kernel[event.name] += event.time_range.elapsed_us() / 1e3
        num_kernels += 1
    # The step ends waiting for the device (the sampled tokens' copy, the synchronisation):
    # those calls' time is the GPU's, not the host's.
    host_ops = {
        a.key: a.self_cpu_time_total / 1e3
        for a in prof.key_averages()
        if not any(wait in a.key for wait in ("Synchronize", "Memcpy", "_local_scalar_dense"))
    }
    total = sum(per_kernel.values())
    idle = device_idle(prof.events())
    matmul = sum(t for name, t in per_kernel.items() if any(m in name for m in MATMUL_MARKERS))
    model = engine.runner.model
    timing = (
        f"wall {min(walls) * 1e3:.1f} ms per step (the host launched it in "
        f"{min(launches) * 1e3:.1f} ms), {num_kernels} GPU kernels {total:.1f} ms"
    )
    if step_tokens:
        layer_weights = sum(p.numel() for p in model.model.layers.parameters())
        ideal = 2 * layer_weights * step_tokens / (args.peak_tflops * 1e12) * 1e3
        print(
            f"{args.prompts} x {args.input_len} tokens after {args.context} cached, "
            f"{args.running} running, {args.policy}: {timing}, "
            f"{min(walls) * 1e3 * 4000 / step_tokens:.1f} ms per 4000 tokens"
        )
        print(
            f"matmuls {matmul:.1f} ms ({100 * matmul / total:.0f}% of kernel time); at "
            f"{args.peak_tflops:.0f} TFLOP/s the decoder layers' matmuls take {ideal:.1f} ms"
        )
    else:
        # A decode step reads every weight but the embedding table (it gathers a few rows).
        weight_bytes = sum(
            p.numel() * p.element_size()
            for name, p in model.named_parameters()
            if "embed_tokens" not in name or model.config.tie_word_embeddings
        )
        ideal = weight_bytes / (args.bandwidth_tbs * 1e12) * 1e3
        print(f"decode-only step of {args.running} sequences, {args.policy}: {timing}")
        print(
            f"matmuls {matmul:.1f} ms ({100 * matmul / total:.0f}% of kernel time); at "
            f"{args.bandwidth_tbs:.2f} TB/s reading the weights once takes {ideal:.1f} ms"
        )
    print(
        f"GPU idle in the step: {idle.before_first * 1e3:.2f} ms before its first kernel (the "
        f"host preparing it), {idle.between * 1e3:.2f} ms in gaps over {GAP_US} us between "
        f"kernels (the longest {idle.longest * 1e3:.2f} ms), {idle.after_last * 1e3:.2f} ms "
        "after its last"
    )
    print(f"{'ms/step':>8} {'share':>6}  kernel")
    for name, t in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{t:8.2f} {100 * t / total:5.1f}%  {name[:90]}")
    host = sum(host_ops.values())
    print(
        f"host: {host:.1f} ms in torch ops and CUDA calls, under the profiler (which adds its own)"
    )
    print(f"{'ms/step':>8} {'share':>6}  host op or call (self time)")
    for name, t in sorted(host_ops.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{t:8.2f} {100 * t / host:5.1f}%  {name[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
