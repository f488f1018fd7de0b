"""The prefix cache as OpenAI clients see it: `usage.prompt_tokens_details.cached_tokens` on
chat and completions, whole and streamed, and vLLM's prefix cache counters on /metrics."""

from __future__ import annotations

import openai
import pytest

from tests.service.servers import MODEL, metric_sum

SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer briefly and cite rule {i}." for i in range(12)
)


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.v1, api_key=real_server.api_key, max_retries=0)


def chat(client: openai.OpenAI, question: str, pool: str, stream: bool = False):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0,
              "extra_body": {"kvsparse": {"policy": pool}}}  # fmt: skip
    if not stream:
        return client.chat.completions.create(**kwargs).usage
    chunks = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    return [c for c in chunks if c.usage is not None][-1].usage


@pytest.mark.parametrize("pool", ["snapkv", "dense"])
def test_a_shared_system_prompt_is_reported_cached(real_server, client, pool):
    before = metric_sum(real_server.metrics(), "vllm:prefix_cache_hits_total")
    first = chat(client, f"What is rule 3? ({pool})", pool)
    again = chat(client, f"What is rule 7? ({pool})", pool)
    streamed = chat(client, f"What is rule 9? ({pool})", pool, stream=True)
    # The system prompt's full blocks (16 tokens each on CPU) are found again.
    assert first.prompt_tokens_details.cached_tokens < first.prompt_tokens
    for usage in (again, streamed):
        assert 100 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens % 16 == 0
    hits = metric_sum(real_server.metrics(), "vllm:prefix_cache_hits_total")
    assert hits - before >= again.prompt_tokens_details.cached_tokens
    assert metric_sum(real_server.metrics(), "vllm:prefix_cache_queries_total") > hits


def test_completions_report_cached_tokens(client):
    prompt = SYSTEM + " Now the question:"
    first = client.completions.create(model=MODEL, prompt=prompt + " one", max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt + " two", max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 100
    assert (
        first.usage.prompt_tokens_details.cached_tokens
        <= again.usage.prompt_tokens_details.cached_tokens
    )
