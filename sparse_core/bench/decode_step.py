"""Decode-only steps, whole: `python -m sparse_core.bench.decode_step` (CUDA only).

Admits `--running` prompts of `--input-len` random tokens, prefills them, then times
`LLMEngine.step()` over `--steps` decode-only steps, once with async scheduling off and once on,
against the decode graph's replay alone (the device's time for the forward pass). The difference
between a step and the replay is the host's time while the device waits: scheduling, input
copies, sampling, reading the tokens back, building outputs. Last it times the sampler on the
step's logits at temperature 1, with top-p 0.9 and with top-k 50 (the greedy steps above only
take an argmax). Prints one line per setting.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from sparse_core.bench.workload import sparsity_for, start_decoding
from sparse_core.config import EngineConfig
from sparse_core.engine.llm_engine import LLMEngine
from sparse_core.engine.sampler import sample
from sparse_core.sampling_params import SamplingParams

SAMPLING = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 1, top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "temperature 1, top-k 50": SamplingParams(temperature=1.0, top_k=50),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama3-8b")
    parser.add_argument("--policy", default="snapkv")
    parser.add_argument("--running", type=int, default=20, help="sequences decoding")
    parser.add_argument("--input-len", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA")
    for async_scheduling in (False, True):
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                max_model_len=args.input_len + args.steps + 608,
                max_num_seqs=max(64, args.running),
                kv_cache_memory_gb=20,
                async_scheduling=async_scheduling,
            ),
            sparsity_for(args.policy),
        )
        held = start_decoding(engine, args.running, args.input_len, random.Random(0))
        if held < args.running:
            parser.error(f"the KV cache holds only {held} of the --running sequences")
        step_ms, ahead, replay_ms = _time_steps(engine, args)
        print(
            f"{args.policy}, {args.running} decoding, async scheduling "
            f"{'on ' if async_scheduling else 'off'}: {step_ms:.2f} ms per step "
            f"({ahead} of {args.steps} launched ahead); the graph replay alone {replay_ms:.2f} ms"
        )
        if not async_scheduling:
            _time_sampling(engine, args.running)
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    return 0


def _time_steps(engine: LLMEngine, args: argparse.Namespace) -> tuple[float, int, float]:
    for _ in range(10):  # warm-up
        engine.step()
    torch.cuda.synchronize()
    engine.step_records = []
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    ahead = sum(record.launched_ahead for record in engine.step_records)
    engine.step_records = None

    graphs = engine.runner.decode_graphs
    if graphs is None:
        raise SystemExit("no decode graphs (--enforce-eager?): nothing to replay")
    graph = graphs.graphs[next(b for b in graphs.buckets if b >= args.running)]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return step_ms, ahead, begin.elapsed_time(end) / args.steps


def _time_sampling(engine: LLMEngine, batch: int, repeats: int = 20) -> None:
    logits = torch.randn(batch, engine.model_config.vocab_size, device=engine.runner.device)
    for name, params in SAMPLING.items():
        seqs = [engine.make_sequence(f"s{i}", [1], params) for i in range(batch)]
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):  # warm-up
            sample(logits, seqs, generator, [True] * batch).tolist()
        start = time.perf_counter()
        for _ in range(repeats):
            sample(logits, seqs, generator, [True] * batch).tolist()
        ms = (time.perf_counter() - start) / repeats * 1e3
        print(f"  sampling {batch} rows, {name}: {ms:.2f} ms per step (ids back on the host)")


if __name__ == "__main__":
    raise SystemExit(main())
