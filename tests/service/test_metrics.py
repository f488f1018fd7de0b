"""Prometheus metrics of the standalone server, and a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio

import httpx
import openai
import prometheus_client
import pytest

from service.metrics import Metrics
from sparse_core import EngineConfig, SparsityConfig
from sparse_core.engine.llm_engine import EngineStats
from tests.service.servers import (
    MODEL,
    abandon_request,
    metric_sum,
    metric_values,
    standalone,
    wait_for,
)

LONG_PROMPT = " ".join(f"Line {i}: the value is {i * 13 % 97}." for i in range(40))

EXPECTED = [
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "kvsparse_kv_blocks_used",
    "kvsparse_kv_blocks_free",
    "kvsparse_compression_ratio_bucket",
    "vllm:request_success_total",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:kv_cache_usage_perc",
]


def test_metrics_are_present_and_move_with_traffic(real_server):
    before = real_server.metrics()
    client = openai.OpenAI(base_url=real_server.v1, api_key=real_server.api_key, max_retries=0)
    out = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=6, temperature=0)
    after = real_server.metrics()

    for name in EXPECTED:
        assert metric_values(after, name, pool="snapkv-64"), name
    # The layer plan the engine resolved: the two layers the server was told to keep whole.
    plan = metric_values(after, "kvsparse_layer_plan_info", pool="snapkv-64")
    assert plan == [1.0]
    assert metric_values(after, "kvsparse_layer_plan_info", full_layers="0,1", source="configured")
    # Counters and histograms moved by exactly this request.
    pool = {"pool": "snapkv-64", "model_name": MODEL}

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **pool, **labels) - metric_sum(
            before, name, **pool, **labels
        )

    assert delta("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 5
    assert delta("vllm:time_to_first_token_seconds_sum") > 0
    assert delta("vllm:request_time_per_output_token_seconds_count") == 1
    # vLLM's KV usage gauge: the share of the pool's blocks every group together uses.
    usage = metric_sum(after, "vllm:kv_cache_usage_perc", **pool)
    used = metric_sum(after, "kvsparse_kv_blocks_used", **pool)
    assert usage == pytest.approx(
        used / (used + metric_sum(after, "kvsparse_kv_blocks_free", **pool))
    )
    # The prompt (~400 tokens) was compressed to a budget of 64 in 28 of 30 layers.
    assert delta("kvsparse_compression_ratio_count") == 1
    assert delta("kvsparse_compression_ratio_sum") > 3
    assert delta("kvsparse_compression_ratio_bucket", le="2.0") == 0
    # The used-blocks gauge has each layer group's share of the pool.
    groups = {
        labels
        for labels in ("full", "budget64")
        if metric_values(after, "kvsparse_kv_blocks_used", group=labels, pool="snapkv-64")
    }
    assert groups == {"full", "budget64"}


def test_gpu_memory_peak_is_shown_as_the_engine_reports_it(real_server):
    """The gauge carries what the engine's stats report, and is absent where they report none
    (this CPU server; on CUDA tests/test_gpu_engine.py checks the reported value)."""
    assert not metric_values(real_server.metrics(), "kvsparse_gpu_memory_peak_bytes")
    registry = prometheus_client.CollectorRegistry()
    recorder = Metrics.prometheus(registry).recorder(model_name=MODEL, pool="p")
    recorder.engine_state(EngineStats(0, 0, 0, {}, gpu_memory_peak_bytes=3 * 2**30))
    text = prometheus_client.generate_latest(registry).decode()
    assert metric_values(text, "kvsparse_gpu_memory_peak_bytes", pool="p") == [3 * 2**30]


def test_refused_requests_are_the_clients_errors_not_the_servers(real_server):
    """A 400 moves neither the server-error counter (the error-rate alert's numerator) nor
    vLLM's success counter."""
    metrics = real_server.metrics()
    errors, finished = (metric_sum(metrics, n) for n in ("kvsparse_request_errors_total",
                                                          "vllm:request_success_total"))  # fmt: skip
    client = openai.OpenAI(base_url=real_server.v1, api_key=real_server.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="word " * 1100, max_tokens=1)
    metrics = real_server.metrics()
    assert metric_sum(metrics, "kvsparse_request_errors_total") == errors
    assert metric_sum(metrics, "vllm:request_success_total") == finished


def blocks_used(server) -> float:
    return metric_sum(server.metrics(), "kvsparse_kv_blocks_used", pool="snapkv-64")


def test_disconnect_mid_stream_aborts_and_frees_kv_blocks(real_server):
    wait_for(lambda: blocks_used(real_server) == 0)  # earlier tests' requests are done
    aborted_before = metric_sum(real_server.metrics(), "vllm:request_success_total",
                                finished_reason="abort")  # fmt: skip
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {real_server.api_key}"}
    with httpx.stream("POST", real_server.v1 + "/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 5:
                break
        # Mid-stream: the request holds KV blocks (gauges refresh every second).
        wait_for(lambda: blocks_used(real_server) > 0)
    # The connection is closed: the request is aborted, its blocks freed.
    wait_for(lambda: blocks_used(real_server) == 0, timeout=10)
    metrics = real_server.metrics()
    assert metric_sum(metrics, "vllm:request_success_total", finished_reason="abort") == (
        aborted_before + 1
    )
    assert metric_sum(metrics, "vllm:num_requests_running", pool="snapkv-64") == 0


def test_a_refused_prompt_aborts_the_ones_before_it_in_its_request(real_server):
    """Each prompt of a request is queued as it is validated: when a later one is refused, the
    earlier ones, queued already, are aborted and their blocks freed."""
    wait_for(lambda: blocks_used(real_server) == 0)
    aborted_before = metric_sum(real_server.metrics(), "vllm:request_success_total",
                                finished_reason="abort")  # fmt: skip
    body = {"model": MODEL, "prompt": [list(range(100, 400)), [10**9]], "max_tokens": 500,
            "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {real_server.api_key}"}
    response = httpx.post(real_server.v1 + "/completions", json=body, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    wait_for(lambda: metric_sum(real_server.metrics(), "vllm:request_success_total",
                                finished_reason="abort") == aborted_before + 1)  # fmt: skip
    wait_for(lambda: blocks_used(real_server) == 0, timeout=10)
    assert metric_sum(real_server.metrics(), "vllm:num_requests_running", pool="snapkv-64") == 0


def test_disconnect_while_waiting_for_a_whole_answer_aborts_too(real_server):
    wait_for(lambda: blocks_used(real_server) == 0)
    aborted_before = metric_sum(real_server.metrics(), "vllm:request_success_total",
                                finished_reason="abort")  # fmt: skip
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 500, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {real_server.api_key}"}
    abandon_request(real_server.v1 + "/completions", body, headers,
                    generating=lambda: blocks_used(real_server) > 0)  # fmt: skip
    wait_for(lambda: metric_sum(real_server.metrics(), "vllm:request_success_total",
                                finished_reason="abort") == aborted_before + 1)  # fmt: skip
    wait_for(lambda: blocks_used(real_server) == 0, timeout=10)


def test_preemptions_are_counted():
    # KV for 512 tokens (2 full sequences) and 4 requests growing to 220 tokens each.
    engine = EngineConfig(model="dummy:tiny", max_model_len=256, kv_cache_memory_gb=0.0005)
    with standalone(engine, [SparsityConfig(policy="dense")]) as server:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0)

        async def run_all() -> list[int]:
            outs = await asyncio.gather(*(
                client.completions.create(model="dummy:tiny", prompt=[5 + i] * 20, max_tokens=200,
                                          extra_body={"ignore_eos": True})
                for i in range(4)
            ))  # fmt: skip
            await client.close()
            return [out.usage.completion_tokens for out in outs]

        assert asyncio.run(run_all()) == [200] * 4
        metrics = wait_for(lambda: metric_values(server.metrics(), "vllm:num_preemptions_total"))
        assert sum(metrics) >= 1
