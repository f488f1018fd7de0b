"""Ray Serve mode on a local 2-CPU cluster: the real model in 2 engine replicas (scaled up from 1
by Serve's autoscaler), the OpenAI ingress, the KV-capacity router and Ray's metrics port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from sparse_core import SamplingParams
from tests.service.servers import (
    API_KEY,
    BAD_REQUESTS,
    MODEL,
    BadRequest,
    Server,
    abandon_request,
    chat_cache_hits,
    check_refused,
    metric_sum,
    ray_serve_app,
    send,
    wait_for,
)

pytestmark = pytest.mark.ray

APP = "kvsparse"
ENGINE = "KVSparseEngine-snapkv-64"
ARGS = {
    "model": MODEL,
    "engine": {"max_model_len": 1024, "max_num_seqs": 16, "kv_cache_memory_gb": 0.25},
    "sparsity": {"policy": "snapkv", "budget": 64, "window": 16, "sinks": 4, "full_layers": 2},
    "api_key": API_KEY,
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,
    # Scale up at once and never back down during the tests. Serve wants the look-back period
    # above its metrics interval field (10 s by default), which the variables below replace.
    "autoscaling_config": {
        "upscale_delay_s": 0,
        "downscale_delay_s": 600,
        "look_back_period_s": 12,
    },
}
# How often replicas and handles report their load to the autoscaler (Serve's default: 10 s).
METRIC_PUSH_INTERVALS = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}


@dataclass
class RayServer(Server):
    metrics_url: str

    def ray_metrics(self) -> str:
        return httpx.get(self.metrics_url, timeout=10).text


def engine_status():
    from ray import serve

    return serve.status().applications[APP].deployments[ENGINE]


def engine_replicas_running() -> int:
    return engine_status().replica_states.get("RUNNING", 0)


@contextlib.contextmanager
def streams_in_flight(server: Server, count: int) -> Iterator[None]:
    """`count` long streaming requests, each generating, until the block exits (disconnect)."""
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {server.api_key}"}
    client = httpx.Client(base_url=server.v1, headers=headers, timeout=120)
    with client, contextlib.ExitStack() as stack:
        lines = []  # kept: dropping an iterator closes its connection
        for _ in range(count):
            response = stack.enter_context(client.stream("POST", "/completions", json=body))
            assert response.status_code == 200, response.read()
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith("data: ")
        yield


@pytest.fixture(scope="module")
def ray_server() -> Iterator[RayServer]:
    """The application on a fresh local cluster, loaded until Serve has scaled it to 2 engine
    replicas: the autoscaling config at work."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in METRIC_PUSH_INTERVALS.items():
            env.setenv(name, value)  # the cluster's processes inherit them
        with ray_serve_app(ARGS, APP, with_metrics=True) as app:
            server = RayServer(app.v1.removesuffix("/v1"), API_KEY,
                               f"http://{app.metrics_address}/metrics")  # fmt: skip
            assert engine_replicas_running() == 1  # min_replicas
            with streams_in_flight(server, 4):  # 4 ongoing > target 2 per replica
                wait_for(lambda: engine_status().status == "UPSCALING", timeout=60, interval=0.2)
            assert engine_status().status_trigger == "AUTOSCALING"
            wait_for(lambda: engine_replicas_running() == 2, timeout=180, interval=0.5)
            yield server


@pytest.fixture(scope="module")
def client(ray_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=ray_server.v1, api_key=API_KEY, max_retries=0)


def greedy(llm, prompts: str | list[str], max_tokens: int) -> str | list[str]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return outs[0].text if isinstance(prompts, str) else [out.text for out in outs]


def test_autoscaling_config_is_in_effect(ray_server):
    from ray import serve
    from ray.serve.context import _get_global_client

    status = serve.status().applications[APP]
    assert status.status == "RUNNING"
    assert status.deployments[ENGINE].replica_states == {"RUNNING": 2}
    details = _get_global_client().get_serve_details()["applications"][APP]["deployments"][ENGINE]
    autoscaling = details["deployment_config"]["autoscaling_config"]
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (1, 2)
    assert autoscaling["target_ongoing_requests"] == 2
    assert details["target_num_replicas"] == 2
    router = details["deployment_config"]["request_router_config"]["request_router_class"]
    assert router.endswith("KVCapacityRouter")


def test_models_and_health(ray_server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(ray_server.base_url + "/health").json() == {"status": "ok"}


def test_completion_and_chat_match_the_engine(client, dense_llm):
    prompt = "The three primary colors are"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == greedy(dense_llm, prompt, 12)
    assert out.usage.completion_tokens == 12

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    expected = dense_llm.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))
    assert chat.choices[0].message.content == expected.text
    assert chat.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streaming(client):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Name three fruits."}],
              "max_tokens": 16, "temperature": 0}  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_twenty_concurrent_requests_are_answered_by_both_replicas(ray_server, dense_llm):
    prompts = [f"Question {i}: what comes after the number {i * 7}? Answer:" for i in range(20)]
    expected = greedy(dense_llm, prompts, 10)
    before = ray_server.ray_metrics()
    client = openai.AsyncOpenAI(base_url=ray_server.v1, api_key=API_KEY, max_retries=0)

    async def ask(prompt: str):
        return await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0
        )

    async def ask_all() -> list:
        try:
            return await asyncio.gather(*(ask(p) for p in prompts))
        finally:
            await client.close()

    outs = asyncio.run(ask_all())
    assert [out.choices[0].text for out in outs] == expected
    generated = sum(out.usage.completion_tokens for out in outs)

    # Metrics, through Ray's metrics export port, moved on both replicas.
    name = "ray_vllm_generation_tokens_total"

    def per_replica(text: str) -> dict[str, float]:
        replicas = set(_label_values(text, name, "replica"))
        return {r: metric_sum(text, name, replica=r) for r in replicas}

    def moved() -> dict[str, float] | None:
        now, then = per_replica(ray_server.ray_metrics()), per_replica(before)
        delta = {r: v - then.get(r, 0.0) for r, v in now.items()}
        return delta if sum(delta.values()) >= generated else None

    delta = wait_for(moved, timeout=30)
    assert sum(delta.values()) == generated
    assert len([r for r, v in delta.items() if v > 0]) == 2, delta


# Out of the default suite: on 2 busy cores it failed about 1 run in 6 while the router gave a
# prefix to the replica it ranked first rather than the one Serve sent the prompt to; it has
# passed every run since, but not yet enough of them to bring it back. Run with -m slow.
@pytest.mark.slow
def test_conversations_keep_their_prefix_cache_hits_across_two_replicas(ray_server, dense_llm):
    """6 chats of 3 turns at once over the 2 replicas: each turn sends the conversation so far
    (a ~300-token document first; together they fit each replica's KV cache, so that what is
    measured is where turns go, not what a full cache evicts). One replica would find every
    earlier turn's full 16-token blocks cached; the router sends each turn to the replica
    holding its conversation, so two find at least 90% as many, and both replicas serve
    conversations."""
    before = ray_server.ray_metrics()
    name = "ray_vllm_prompt_tokens_total"
    prompt, cached, one_replica = chat_cache_hits(ray_server.v1, dense_llm.tokenizer)
    assert one_replica > 0.5 * prompt
    assert cached >= 0.9 * one_replica, (cached, one_replica, prompt)

    def moved() -> dict[str, float] | None:
        now = ray_server.ray_metrics()
        replicas = set(_label_values(now, name, "replica"))
        delta = {r: metric_sum(now, name, replica=r) - metric_sum(before, name, replica=r)
                 for r in replicas}  # fmt: skip
        return delta if sum(delta.values()) >= prompt else None

    delta = wait_for(moved, timeout=30)
    assert len([r for r, v in delta.items() if v > 0]) == 2, delta


def test_engine_metrics_on_rays_port(ray_server):
    text = ray_server.ray_metrics()
    for name in [
        "ray_vllm_time_to_first_token_seconds_bucket",
        "ray_vllm_inter_token_latency_seconds_bucket",
        "ray_vllm_e2e_request_latency_seconds_bucket",
        "ray_vllm_prompt_tokens_total",
        "ray_vllm_num_requests_running",
        "ray_vllm_num_requests_waiting",
        "ray_kvsparse_kv_blocks_used",
        "ray_kvsparse_kv_blocks_free",
        "ray_kvsparse_compression_ratio_bucket",
        "ray_vllm_request_success_total",
        "ray_vllm_kv_cache_usage_perc",
        "ray_vllm_request_time_per_output_token_seconds_bucket",
    ]:
        assert metric_sum(text, name, pool="snapkv-64", model_name=MODEL) >= 0, name
        assert f"{name}{{" in text, name
    assert len(set(_label_values(text, "ray_kvsparse_kv_blocks_free", "replica"))) == 2
    # No /metrics on the ingress in Ray mode: the cluster's port is the scrape target.
    assert httpx.get(ray_server.base_url + "/metrics").status_code == 404


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=lambda c: c.name)
def test_bad_request_is_refused(ray_server, case: BadRequest):
    check_refused(send(ray_server, case), case)


def test_wrong_api_key_is_refused(ray_server):
    client = openai.OpenAI(base_url=ray_server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert err.value.body["code"] == "invalid_api_key"
    assert httpx.get(ray_server.v1 + "/models").status_code == 401


def test_body_over_the_limit_is_413(ray_server):
    body = {"model": MODEL, "prompt": "x" * (5 * 2**20)}
    response = httpx.post(ray_server.v1 + "/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert response.status_code == 413


def test_disconnect_mid_stream_frees_kv_blocks(ray_server):
    def used_blocks() -> float:
        return metric_sum(ray_server.ray_metrics(), "ray_kvsparse_kv_blocks_used")

    def aborted() -> float:
        return metric_sum(ray_server.ray_metrics(), "ray_vllm_request_success_total",
                          finished_reason="abort")  # fmt: skip

    wait_for(lambda: used_blocks() == 0, timeout=30)
    aborted_before = aborted()
    with streams_in_flight(ray_server, 2):
        wait_for(lambda: used_blocks() > 0, timeout=30)  # both requests hold KV blocks
    # Both clients went away: each replica aborted its request and freed the blocks.
    wait_for(lambda: aborted() == aborted_before + 2, timeout=30)
    wait_for(lambda: used_blocks() == 0, timeout=30)

    # The same for a client waiting for a whole (non-streamed) answer.
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400,
            "ignore_eos": True}  # fmt: skip
    abandon_request(ray_server.v1 + "/completions", body, {"Authorization": f"Bearer {API_KEY}"},
                    generating=lambda: used_blocks() > 0)  # fmt: skip
    wait_for(lambda: aborted() == aborted_before + 3, timeout=30)
    wait_for(lambda: used_blocks() == 0, timeout=30)


def _label_values(text: str, name: str, label: str) -> list[str]:
    import re

    return re.findall(rf'^{re.escape(name)}\{{[^}}]*\b{label}="([^"]*)"', text, flags=re.M)


@pytest.fixture
def queue_of_one(ray_server) -> Iterator[str]:
    """A second application: one slow engine replica taking 1 request at a time, and 1 more
    queued at the ingress's handle."""
    from ray import serve

    from service.ray_app import build_app

    args = {
        "model": "dummy:smollm2-135m",  # random weights: slow enough to hold a request
        "engine": {"max_model_len": 2048, "kv_cache_memory_gb": 0.25},
        "sparsity": {"policy": "dense"},
        "max_ongoing_requests": 1,
        "max_queued_requests": 1,
        "num_cpus_per_replica": 0,  # the 2 CPUs are the other application's
    }
    serve.run(build_app(args), name="queue-of-one", route_prefix="/queue-of-one")
    try:
        yield f"{ray_server.base_url}/queue-of-one/v1"
    finally:
        serve.delete("queue-of-one")


def test_full_queue_is_503_with_retry_after(queue_of_one):
    long = {"model": "dummy:smollm2-135m", "prompt": "Go", "max_tokens": 2000, "ignore_eos": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=queue_of_one, timeout=120) as client:
            stream = client.stream("POST", "/completions", json={**long, "stream": True})
            async with stream as running:
                lines = running.aiter_lines()  # kept: dropping it would close the connection
                assert (await anext(lines)).startswith("data: ")
                queued = asyncio.create_task(
                    client.post("/completions", json={**long, "max_tokens": 2})
                )
                await asyncio.sleep(1)
                refused = await client.post("/completions", json={**long, "max_tokens": 2})
                assert refused.status_code == 503
                assert int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["code"] == "server_overloaded"
            # The running request's client left: it is aborted, the queued one runs.
            served = await queued
            assert served.status_code == 200
            assert served.json()["usage"]["completion_tokens"] == 2

    asyncio.run(scenario())
