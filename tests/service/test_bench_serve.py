"""`kvsparse bench serve` against a running server, at tiny sizes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from service.cli import main
from sparse_core import EngineConfig, SparsityConfig
from sparse_core.bench.serve import (
    ServerReading,
    add_arguments,
    default_metrics_url,
    num_processes,
    parse_server_metrics,
    percentile,
)
from sparse_core.bench.serve_clients import warm_up
from tests.service.servers import metric_values, standalone


@pytest.fixture(scope="module")
def server():
    engine = EngineConfig(model="dummy:tiny", max_model_len=256, kv_cache_memory_gb=0.01)
    with standalone(engine, [SparsityConfig(policy="dense")]) as running:
        yield running


def bench(server, tmp_path, *load_flags: str) -> tuple[int, dict]:
    """`kvsparse bench serve` of 24-token prompts and 6-token outputs: exit code and report."""
    output = tmp_path / "bench.json"
    code = main(["bench", "serve", "--base-url", server.v1, "--api-key", server.api_key,
                 "--input-len", "24", "--output-len", "6", "--token-range", "1:250",
                 "--output", str(output), *load_flags])  # fmt: skip
    return code, json.loads(output.read_text())


def test_open_loop_sends_every_request_at_each_rate(server, tmp_path, capsys):
    code, report = bench(
        server, tmp_path, "--request-rate", "50,100", "--num-requests", "5", "--metrics-url", ""
    )
    assert code == 0
    assert [level["request_rate"] for level in report["levels"]] == [50.0, 100.0]
    for level in report["levels"]:
        assert level["concurrency"] is None
        assert (level["requests"], level["errors"]) == (5, 0)
        assert abs(level["output_tok_per_s"] * level["wall_s"] - 5 * 6) < 0.05 * 30
        assert 0 < level["ttft_p50_s"] <= level["ttft_max_s"]
        assert level["ttft_p50_by_round_s"] == []
        assert level["server_ttft_mean_s"] is None  # no metrics asked for
        assert sorted(r["client"] for r in level["request_results"]) == list(range(5))
    assert "| 100 req/s | 5 |" in capsys.readouterr().out


@pytest.mark.parametrize("processes", [[], ["--processes", "2"]], ids=["default", "2"])
def test_sweep_reports_every_level(server, tmp_path, capsys, processes):
    """By default these few clients share one load generator process; with --processes 2 they
    are dealt out over two, which start each level together."""
    code, report = bench(server, tmp_path, "--concurrency", "1,3", "--requests-per-client", "2",
                         "--label", "tiny", *processes)  # fmt: skip
    assert code == 0
    assert (report["model"], report["label"]) == ("dummy:tiny", "tiny")
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert level["requests"] == 2 * level["concurrency"]
        assert level["errors"] == 0
        # ignore_eos: exactly output-len tokens each; prompts of exactly input-len tokens.
        tokens = level["requests"] * 6
        assert abs(level["output_tok_per_s"] * level["wall_s"] - tokens) < 0.05 * tokens
        total = level["requests"] * (24 + 6)
        assert abs(level["total_tok_per_s"] * level["wall_s"] - total) < 0.05 * total
        assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"] <= level["ttft_max_s"]
        assert level["tpot_p50_s"] > 0
        assert level["e2e_p50_s"] >= level["ttft_p50_s"]
        # The server's TTFT histogram, read around the level: a part of each client's TTFT.
        assert 0 < level["server_ttft_mean_s"] <= level["ttft_mean_s"]
        assert level["server_gpu_memory_peak_gib"] is None  # engines on a CPU report none
        rounds = level["ttft_p50_by_round_s"]
        assert len(rounds) == 2 and all(0 < t <= level["ttft_max_s"] for t in rounds)
        # Each client sends its next request only after the previous one finished.
        sent = {(r["client"], r["round"]): r for r in level["request_results"]}
        assert sorted(sent) == [(c, k) for c in range(level["concurrency"]) for k in range(2)]
        assert level["start_unix_s"] > 1.7e9  # a Unix time, for lining up a server's step log
        for c in range(level["concurrency"]):
            first, second = sent[c, 0], sent[c, 1]
            assert 0 <= first["start_s"] < first["start_s"] + first["e2e_s"] <= second["start_s"]
            assert first["start_s"] < 0.5  # every client starts with the level
        ends = [r["start_s"] + r["e2e_s"] for r in level["request_results"]]
        assert ends == sorted(ends) and ends[-1] <= level["wall_s"] + 0.001  # rounded to ms
        # Clients are dealt out over the processes in turn: client c to process c % count.
        count = 2 if processes else 1
        assert all(r["process"] == r["client"] % count for r in level["request_results"])
    assert "| 3 clients | 6 |" in capsys.readouterr().out  # the table


def test_a_report_plots_as_curves_and_request_by_request(server, tmp_path):
    from sparse_core.bench import plot_serve

    code, _ = bench(server, tmp_path, "--concurrency", "1,2", "--requests-per-client", "2")
    assert code == 0
    report = str(tmp_path / "bench.json")
    for flags in ([], ["--per-request", "--target", "0.3"]):
        png = tmp_path / f"plot{len(flags)}.png"
        plot_serve.main([str(png), report, report, "--labels", "a,b", *flags])
        assert png.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(SystemExit):  # a vLLM sweep has no per-request results
        plot_serve.main([str(tmp_path / "x.png"), report, "--per-request", "--vllm-sweep", report])


def test_vllm_sweeps_plot_beside_a_report_labelled_by_their_dtypes(tmp_path):
    """Stock vLLM's sweeps in bf16 and in fp8/fp8 (the JSON line its peer sweep.py prints) go on
    one plot, each named by its weights and KV cache dtypes."""
    from sparse_core.bench import plot_serve

    rows = [{"concurrency": c, "output_tok_per_s": 100.0 * c, "ttft_p50_s": 0.1} for c in (1, 2)]
    sweeps = {"bf16": {"gmu": 0.17, "rows": rows},
              "fp8": {"gmu": 0.17, "kv_cache_dtype": "fp8", "quantization": "fp8", "rows": rows}}  # fmt: skip
    paths = []
    for name, sweep in sweeps.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"vllm_ttft_sweep": sweep}))
    labels = [plot_serve.load_vllm_sweep(str(path))[0] for path in paths]
    assert labels == [
        "stock vLLM 0.24 bf16/bf16 (in-process)",
        "stock vLLM 0.24 fp8/fp8 (in-process)",
    ]
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"label": "kvsparse", "levels": rows}))
    png = tmp_path / "plot.png"
    plot_serve.main(
        [str(png), str(report), "--vllm-sweep", str(paths[0]), "--vllm-sweep", str(paths[1])]
    )
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "killed"])
def test_a_stopped_benchmark_takes_its_processes_and_requests_along(server, sig):
    """Interrupted in the middle of a level (Ctrl-C), or killed without a chance to clean up,
    the benchmark ends within seconds, and so do its load generator processes: the server sees
    their requests end and nothing left running."""

    def running() -> float:
        return sum(metric_values(server.metrics(), "vllm:num_requests_running"))

    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "bench", "serve", "--base-url", server.v1,
         "--api-key", server.api_key, "--input-len", "24", "--output-len", "200",
         "--token-range", "1:250", "--concurrency", "4", "--requests-per-client", "1000",
         "--processes", "2", "--metrics-url", ""],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # As from a terminal: a shell that starts jobs in the background ignores SIGINT for them.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while running() < 3:  # the level's clients, not the warm-up request
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "interrupted" in err
    else:
        assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 30
    while running() > 0:
        assert time.monotonic() < deadline, "requests of the stopped load generator still run"
        time.sleep(0.2)


def test_clients_are_spread_over_a_process_per_ten_by_default():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    processes = [num_processes(parser.parse_args(flags)) for flags in (
        [], ["--concurrency", "1,5,10"], ["--concurrency", "11"], ["--processes", "3"],
        ["--request-rate", "1", "--num-requests", "30"],
    )]  # fmt: skip
    cores = os.cpu_count() or 1
    assert processes == [min(cores, 4), 1, min(cores, 2), 3, min(cores, 3)]
    with pytest.raises(SystemExit):
        parser.parse_args(["--processes", "0"])


def test_warm_up_makes_a_call_per_client_and_tolerates_a_dead_server(server):
    """Before a level, each client of a load process makes one call (setting the `openai`
    client up and opening its connection); a server that does not answer is left to the
    level's requests to report."""
    import httpx
    from openai import AsyncOpenAI

    async def warm(base_url: str) -> list[tuple[str, int]]:
        answered: list[tuple[str, int]] = []

        async def record(response: httpx.Response) -> None:
            answered.append((response.request.url.path, response.status_code))

        http = httpx.AsyncClient(event_hooks={"response": [record]})
        client = AsyncOpenAI(base_url=base_url, api_key=server.api_key, max_retries=0,
                             http_client=http, timeout=5)  # fmt: skip
        await warm_up(client, 3)
        await client.close()
        return answered

    assert asyncio.run(warm(server.v1)) == [("/v1/models", 200)] * 3
    with socket.socket() as closed:  # a port with nothing listening
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert asyncio.run(warm(f"http://127.0.0.1:{port}/v1")) == []


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0


def test_a_rate_that_is_not_positive_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--request-rate", "2,0"])
    assert exit_info.value.code == 2
    assert "expected positive numbers, got '2,0'" in capsys.readouterr().err


def test_server_metrics_are_summed_over_label_sets_from_prometheus_text():
    text = "\n".join([
        "# HELP vllm:time_to_first_token_seconds Time from request arrival ...",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="a b}"} 1.0',
        'vllm:time_to_first_token_seconds_sum{model_name="a b}"} 0.5',
        'vllm:time_to_first_token_seconds_count{model_name="a b}"} 2.0',
        'vllm:time_to_first_token_seconds_sum{model_name="c"} 1.5',
        'vllm:time_to_first_token_seconds_count{model_name="c"} 3.0',
        "vllm:time_to_first_token_seconds_created 1.7e9",
        "vllm:num_requests_running 4.0",
        'kvsparse_gpu_memory_peak_bytes{pool="a"} 2.5e10',
        'kvsparse_gpu_memory_peak_bytes{pool="b"} 2.25e10',
    ])  # fmt: skip
    # TTFT summed, GPU memory the highest of the engines'.
    assert parse_server_metrics(text) == ServerReading(2.0, 5.0, 2.5e10)
    unlabelled = "vllm:time_to_first_token_seconds_sum 0.25 1700000000\n" + (
        "vllm:time_to_first_token_seconds_count 1"
    )
    assert parse_server_metrics(unlabelled) == ServerReading(0.25, 1.0, None)
    # Ray's name of it is not on a server's own /metrics.
    assert parse_server_metrics("ray_vllm_time_to_first_token_seconds_sum 3.0\n") is None
    assert default_metrics_url("http://host:8000/v1") == "http://host:8000/metrics"


def test_the_server_command_does_not_need_the_benchmark_clients():
    """`kvsparse serve` runs where only the serving extra is installed: the load generator's
    HTTP clients (openai, httpx) are imported when a benchmark runs, not with the CLI."""
    script = "import sys; sys.modules['httpx'] = sys.modules['openai'] = None; import service.cli"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_multi_turn_sends_each_conversation_with_the_servers_answers(server, tmp_path, capsys):
    """--turns 3: every later turn's prompt is the previous one, the server's 6 answer tokens
    and 10 new ones; the server finds the previous prompt's full 16-token blocks cached."""
    code, report = bench(server, tmp_path, "--concurrency", "2", "--requests-per-client", "2",
                         "--turns", "3", "--turn-input-len", "10",
                         "--metrics-url", "")  # fmt: skip
    assert code == 0
    (level,) = report["levels"]
    assert (level["requests"], level["errors"]) == (2 * 2 * 3, 0)
    results = level["request_results"]
    for client in (0, 1):
        mine = sorted((r for r in results if r["client"] == client), key=lambda r: r["round"])
        assert [r["round"] for r in mine] == list(range(6))
        assert [r["turn"] for r in mine] == [0, 1, 2] * 2
        assert [r["prompt_tokens"] for r in mine] == [24, 40, 56] * 2
        for r in mine:
            previous_prompt = 24 + 16 * (r["turn"] - 1)
            floor = previous_prompt // 16 * 16 if r["turn"] else 0
            assert floor <= r["cached_tokens"] < r["prompt_tokens"], r
    cached = sum(r["cached_tokens"] for r in results)
    assert level["prefix_cache_hit_rate"] == round(cached / (12 * 40), 4) > 0
    assert f"| {level['prefix_cache_hit_rate']:.1%} |" in capsys.readouterr().out
