"""`kvsparse bench serve`: load against any OpenAI-compatible server (ours, vLLM...).

Closed loop (`--concurrency`, the default): at each level C, C clients each keep one streaming
request in flight until each has sent `--requests-per-client`. Open loop (`--request-rate`):
at each rate, `--num-requests` requests arrive at random (Poisson) times, whatever the server's
progress, as independent users do. Prompts are random token ids (exactly `--input-len` tokens, no
tokenizer needed on the client), outputs are exactly `--output-len` tokens (`ignore_eos`, vLLM's
extension, which our server also takes). Per level: TTFT p50/p99/max, time per output token
(TPOT: (end-to-end - TTFT) / (tokens - 1)) p50/p99, end-to-end p50, output and total tokens/s,
and the share of prompt tokens the server found in its prefix cache
(`usage.prompt_tokens_details.cached_tokens`), and in the JSON report every request's send time
(from the level's start, also given as Unix time to line up with a server's `--step-log`), TTFT,
end-to-end time and the load generator process that sent it. Where the server exposes vLLM's TTFT
histogram (`--metrics-url`, by default `/metrics` beside the API; `kvsparse serve` and `vllm
serve` do), each level also reports the server's own mean TTFT (from when it has parsed a request), which leaves
out the wire, the streaming and this process's event loop: the like-for-like figure beside a peer
measured in-process; and, on a GPU, the highest peak GPU memory of the server's engine
processes. The clients run in processes of their own (`--processes`,
sparse_core/bench/serve_clients.py), so that parsing the streams is not what limits the measurement.

Multi-turn (`--turns N`): each request of a client opens a conversation of N turns, as a chat
client sends them: the first turn is `--input-len` tokens (a document and a question), and each
later one sends the conversation so far (the previous turn's prompt and the server's own answer,
as token ids through vLLM's `return_token_ids`) followed by `--turn-input-len` new tokens; each
turn generates `--output-len` tokens. A server with a prefix cache prefills only what is new.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import sys
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from sparse_core.bench.serve_clients import (
    CLIENTS_PER_PROCESS,
    ClientJob,
    ClientProcesses,
    ClientSettings,
    JobsDone,
    RequestResult,
    one_request,
)

# The server's TTFT histogram (vLLM's name, service/metrics.py): from when the API server has
# parsed a request to its first token out of the engine.
SERVER_TTFT_METRIC = "vllm:time_to_first_token_seconds"
SERVER_GPU_MEMORY_METRIC = "kvsparse_gpu_memory_peak_bytes"


@dataclass
class LevelResult:
    concurrency: int | None  # closed loop: clients
    request_rate: float | None  # open loop: mean arrivals per second
    requests: int
    errors: int
    start_unix_s: float  # what the requests' start_s count from, to line up a server's step log
    wall_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_max_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    ttft_mean_s: float
    # Prompt tokens the server reported cached over all prompt tokens (0 without the field).
    prefix_cache_hit_rate: float
    # The server's mean TTFT over the level's requests, from when it had parsed each one; None
    # when the server exposes no such histogram (a wrong --metrics-url; Ray mode: metrics are on
    # Ray's port there, under Ray's names).
    server_ttft_mean_s: float | None
    # The highest peak GPU memory of the server's engine processes by the level's end (CUDA
    # context included); None off CUDA or without kvsparse metrics.
    server_gpu_memory_peak_gib: float | None
    # Closed loop: TTFT p50 of each round (the first arrives at once, later ones as requests
    # finish); empty in open loop.
    ttft_p50_by_round_s: list[float]
    # Every request in the order it finished: when it was sent and how it went, to see how
    # arrivals bunch up.
    request_results: list[RequestResult]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def random_prompts(
    count: int, args: argparse.Namespace, rng: random.Random, length: int | None = None
) -> list[list[int]]:
    lo, hi = args.token_range
    length = args.input_len if length is None else length
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(count)]


def follow_ups(count: int, args: argparse.Namespace, rng: random.Random) -> list[list[list[int]]]:
    """For each of `count` conversations, the new tokens of its turns after the first (none
    without --turns)."""
    if args.turns == 1:
        return []
    return [random_prompts(args.turns - 1, args, rng, args.turn_input_len) for _ in range(count)]


def summarize(
    start_unix_s: float,
    done: JobsDone,
    concurrency: int | None = None,
    request_rate: float | None = None,
    rounds: int = 0,
) -> LevelResult:
    results, errors, wall = done.results, done.errors, done.end_s
    if errors:
        print(f"  {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    ttfts = [r.ttft_s for r in results]
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in results)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    all_tokens = out_tokens + prompt_tokens
    return LevelResult(
        concurrency=concurrency,
        request_rate=request_rate,
        requests=len(results),
        errors=len(errors),
        start_unix_s=round(start_unix_s, 6),
        wall_s=round(wall, 3),
        output_tok_per_s=round(out_tokens / wall, 2),
        total_tok_per_s=round(all_tokens / wall, 2),
        ttft_p50_s=round(percentile(ttfts, 50), 4),
        ttft_p99_s=round(percentile(ttfts, 99), 4),
        ttft_max_s=round(max(ttfts, default=float("nan")), 4),
        tpot_p50_s=round(percentile(tpots, 50), 5),
        tpot_p99_s=round(percentile(tpots, 99), 5),
        e2e_p50_s=round(percentile([r.e2e_s for r in results], 50), 4),
        ttft_mean_s=round(sum(ttfts) / len(ttfts), 4) if ttfts else float("nan"),
        prefix_cache_hit_rate=round(
            sum(r.cached_tokens for r in results) / prompt_tokens if prompt_tokens else 0.0, 4
        ),
        # Filled in by the caller, which reads the server's metrics.
        server_ttft_mean_s=None,
        server_gpu_memory_peak_gib=None,
        ttft_p50_by_round_s=[
            round(percentile([r.ttft_s for r in results if r.round == k], 50), 4)
            for k in range(rounds)
        ],
        request_results=sorted(results, key=lambda r: r.start_s + r.e2e_s),
    )


@dataclass
class LevelPlan:
    """One load level: its clients' jobs, and how the report names it."""

    jobs: list[ClientJob]
    concurrency: int | None = None
    request_rate: float | None = None
    rounds: int = 0


def closed_loop(concurrency: int, per_client: int, args: argparse.Namespace, rng) -> LevelPlan:
    """`concurrency` clients, each sending `per_client` requests (conversations, with --turns)
    one after another."""
    prompts = random_prompts(concurrency * per_client, args, rng)
    turns = follow_ups(len(prompts), args, rng)
    jobs = [
        ClientJob(
            c,
            prompts[c * per_client : (c + 1) * per_client],
            0.0,
            turns[c * per_client : (c + 1) * per_client],
        )
        for c in range(concurrency)
    ]
    return LevelPlan(jobs, concurrency=concurrency, rounds=per_client * args.turns)


def open_loop(rate: float, args: argparse.Namespace, rng) -> LevelPlan:
    """`--num-requests` requests (conversations, with --turns) at Poisson arrival times of mean
    rate `rate`/s."""
    prompts = random_prompts(args.num_requests, args, rng)
    turns = follow_ups(len(prompts), args, rng)
    arrivals = itertools.accumulate(rng.expovariate(rate) for _ in prompts)
    jobs = [
        ClientJob(i, [p], at, turns[i : i + 1])
        for i, (p, at) in enumerate(zip(prompts, arrivals, strict=True))
    ]
    return LevelPlan(jobs, request_rate=rate)


def num_processes(args: argparse.Namespace) -> int:
    """--processes, or one per CLIENTS_PER_PROCESS clients of the largest level (open loop: per
    CLIENTS_PER_PROCESS requests of a rate, the most that could be in flight at once), at most
    one per CPU core this process may run on."""
    if args.processes:
        return args.processes
    clients = args.num_requests if args.request_rate else max(args.concurrency, default=1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, math.ceil(clients / CLIENTS_PER_PROCESS)))


@dataclass
class ServerReading:
    """The server's metrics at one moment: its TTFT histogram's sum and count over every label
    set, and the highest peak GPU memory of its engines (None where none is exported)."""

    ttft_sum_s: float
    ttft_count: float
    gpu_memory_peak_bytes: float | None


def parse_server_metrics(metrics_text: str) -> ServerReading | None:
    """A ServerReading from Prometheus text; None without vLLM's TTFT histogram (which
    `kvsparse serve` and `vllm serve` export)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    peaks: list[float] = []
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in (SERVER_TTFT_METRIC + "_sum", SERVER_TTFT_METRIC + "_count"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            elif sample.name == SERVER_GPU_MEMORY_METRIC:
                peaks.append(sample.value)
    if len(totals) < 2:
        return None
    return ServerReading(
        totals[SERVER_TTFT_METRIC + "_sum"],
        totals[SERVER_TTFT_METRIC + "_count"],
        max(peaks, default=None),
    )


@dataclass
class ServerMetrics:
    """The server's metrics endpoint, read before and after each level."""

    url: str
    headers: dict[str, str]

    async def read(self) -> ServerReading | None:
        """None when there is no such metric to read: a benchmark goes on without it."""
        if not self.url:
            return None
        import httpx  # the bench extra's (openai's too): not imported by `kvsparse serve`

        try:
            async with httpx.AsyncClient(headers=self.headers, timeout=30) as http:
                response = await http.get(self.url)
            response.raise_for_status()
            return parse_server_metrics(response.text)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, IndexError):
            return None

    @staticmethod
    def record(
        level: LevelResult, before: ServerReading | None, after: ServerReading | None
    ) -> None:
        """The level's server-side figures: the mean TTFT of the requests between the two
        readings, and the peak memory at the second."""
        if before is not None and after is not None and after.ttft_count > before.ttft_count:
            mean = (after.ttft_sum_s - before.ttft_sum_s) / (after.ttft_count - before.ttft_count)
            level.server_ttft_mean_s = round(mean, 4)
        if after is not None and after.gpu_memory_peak_bytes is not None:
            level.server_gpu_memory_peak_gib = round(after.gpu_memory_peak_bytes / 2**30, 2)


def default_metrics_url(base_url: str) -> str:
    """`/metrics` at the API's host: where `kvsparse serve` (standalone) exposes them."""
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}/metrics"


async def run(args: argparse.Namespace) -> dict:
    metrics_url = (
        default_metrics_url(args.base_url) if args.metrics_url is None else args.metrics_url
    )
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server_metrics = ServerMetrics(metrics_url, headers)
    settings = ClientSettings(args.base_url, args.api_key or "none", args.model or "",
                              args.output_len, args.timeout, args.turns > 1)  # fmt: skip
    rng = random.Random(args.seed)
    client = settings.client()
    try:
        settings.model = settings.model or (await client.models.list()).data[0].id
        # Warm-up, not measured: the server's first request may compile or allocate.
        await one_request(
            client, settings.model, random_prompts(1, args, rng)[0], 2, settings.return_token_ids
        )
    finally:
        await client.close()
    if args.request_rate:
        plans = [open_loop(rate, args, rng) for rate in args.request_rate]
    else:
        plans = [
            closed_loop(c, args.requests_per_client or (3 if c <= 10 else 2), args, rng)
            for c in args.concurrency
        ]
    levels = []
    with ClientProcesses(num_processes(args), settings) as processes:
        for plan in plans:
            before = await server_metrics.read()
            start_unix_s, done = await asyncio.to_thread(processes.run, plan.jobs)
            level = summarize(start_unix_s, done, plan.concurrency, plan.request_rate, plan.rounds)
            ServerMetrics.record(level, before, await server_metrics.read())
            levels.append(level)
            summary = {k: v for k, v in asdict(level).items() if k != "request_results"}
            print(json.dumps(summary), file=sys.stderr, flush=True)
    return {
        "base_url": args.base_url,
        "model": settings.model,
        "label": args.label,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "turns": args.turns,
        "turn_input_len": args.turn_input_len,
        "levels": [asdict(level) for level in levels],
    }


def table(report: dict) -> str:
    rows = [
        "| load | requests | output tok/s | TTFT p50 | TTFT p99 | TTFT max | TPOT p50 "
        "| TTFT p50 per round | TTFT mean (server's) | GPU memory peak (server's) "
        "| prompt tokens cached |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in report["levels"]:
        server = lv["server_ttft_mean_s"]
        server = "-" if server is None else f"{server:.3f} s"
        memory = lv["server_gpu_memory_peak_gib"]
        memory = "-" if memory is None else f"{memory:.2f} GiB"
        load = (
            f"{lv['concurrency']} clients"
            if lv["concurrency"] is not None
            else f"{lv['request_rate']:g} req/s"
        )
        rows.append(
            f"| {load} | {lv['requests']} | {lv['output_tok_per_s']:,.0f} | "
            f"{lv['ttft_p50_s']:.3f} s | {lv['ttft_p99_s']:.3f} s | {lv['ttft_max_s']:.3f} s | "
            f"{lv['tpot_p50_s'] * 1000:.1f} ms | "
            f"{' / '.join(f'{t:.2f}' for t in lv['ttft_p50_by_round_s']) or '-'} | "
            f"{lv['ttft_mean_s']:.3f} s ({server}) | {memory} | "
            f"{lv['prefix_cache_hit_rate']:.1%} |"
        )
    return "\n".join(rows)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _token_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--metrics-url",
        default=None,
        help="the server's Prometheus endpoint, for its own TTFT (default: /metrics at the "
        "--base-url host; '' to skip)",
    )
    parser.add_argument("--concurrency", type=_ints, default=[1, 5, 10, 20, 40])
    parser.add_argument(
        "--request-rate",
        type=_floats,
        default=None,
        help="open loop instead: mean arrivals per second, e.g. 1,2,4 (Poisson arrivals)",
    )
    parser.add_argument(
        "--num-requests", type=int, default=40, help="requests per rate (open loop)"
    )
    parser.add_argument("--input-len", type=int, default=4000)
    parser.add_argument("--output-len", type=int, default=500)
    parser.add_argument(
        "--requests-per-client",
        type=int,
        default=None,
        help="requests (conversations, with --turns) per client; default: 3 up to C=10, then 2",
    )
    parser.add_argument(
        "--turns",
        type=_positive_int,
        default=1,
        help="turns per conversation: each later turn sends the conversation so far (with the "
        "server's answers, through vLLM's return_token_ids) and --turn-input-len new tokens",
    )
    parser.add_argument(
        "--turn-input-len", type=_positive_int, default=100, help="new tokens of each later turn"
    )
    parser.add_argument(
        "--token-range",
        type=_token_range,
        default=(100, 30000),
        help="LO:HI, random prompt token ids are drawn from [LO, HI) (fits the vocabularies of "
        "Llama, Mistral, Qwen, SmolLM)",
    )
    parser.add_argument(
        "--processes",
        type=_positive_int,
        default=None,
        help=f"load generator processes the clients are spread over (default: one per "
        f"{CLIENTS_PER_PROCESS} clients of the largest level, at most one per CPU core)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--label", default=None, help="a name for this run in the JSON")
    parser.add_argument("--output", default=None, help="write the JSON report here")
    parser.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        report = asyncio.run(run(args))
    except KeyboardInterrupt:  # the load generator processes are stopped already
        print("interrupted", file=sys.stderr)
        return 130
    print(table(report))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    failed = sum(level["errors"] for level in report["levels"])
    return 1 if failed else 0
