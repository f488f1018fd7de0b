"""The standalone server through the official `openai` client: completions, chat with the model's
template, streaming, concurrency, n, stop, and the per-request sparsity extension."""

from __future__ import annotations

import asyncio
import os

import openai
import pytest

from sparse_core import LLM, SamplingParams
from sparse_core.models.loader import builtin_model_path
from tests.service.servers import MODEL

LONG_PROMPT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60))


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.v1, api_key=real_server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def reference(dense_llm) -> LLM:
    """The engine called directly. Dense: every prompt compared with it is shorter than the
    server's snapkv budget, so the snapkv pool keeps it whole and must answer the same."""
    return dense_llm


def greedy(reference: LLM, prompt: str | list[int], max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return reference.generate(prompt, params)[0].text


def greedy_batch(reference: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [out.text for out in reference.generate(prompts, params)]


def test_models_lists_the_served_model_and_its_pools(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    pools = models[0].model_extra["kvsparse"]["pools"]
    assert [p["name"] for p in pools] == ["snapkv-64", "dense"]
    # What each keeps whole, as configured (tests/service/servers.py: the first 2 layers).
    assert [p["full_layers"] for p in pools] == ["first 2", "all"]


def test_completion_matches_the_engine(client, reference):
    prompt = "The three primary colors are"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].text == greedy(reference, prompt, 12)
    assert out.choices[0].finish_reason == "length"
    n_prompt = len(reference.tokenizer.encode(prompt))
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == n_prompt + 12


def test_completion_of_token_ids(client, reference):
    ids = reference.tokenizer.encode("Once upon a time")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy(reference, ids, 8)


def test_chat_uses_the_models_template(client, reference):
    from transformers import PreTrainedTokenizerFast

    path = builtin_model_path(MODEL)
    hf = PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    templated = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in templated  # SmolLM2's ChatML template

    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    expected = reference.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))
    assert out.choices[0].message.content == expected.text
    assert "Paris" in out.choices[0].message.content
    assert out.usage.prompt_tokens == len(hf.encode(templated, add_special_tokens=False))


def test_chat_content_parts_and_default_max_tokens(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
        temperature=0,
    )  # no max_tokens: up to the context, so the model stops by itself
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content


def test_streaming_completion_equals_the_whole_answer(client):
    kwargs = {"model": MODEL, "prompt": "List some fruits:", "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 20  # one chunk per generated token
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_chat_sends_the_role_first(client):
    messages = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_twenty_concurrent_requests_answer_like_single_ones(real_server, reference):
    prompts = [f"Question {i}: what comes after the number {i * 7}? Answer:" for i in range(20)]
    expected = greedy_batch(reference, prompts, 10)
    client = openai.AsyncOpenAI(base_url=real_server.v1, api_key=real_server.api_key)

    async def ask(prompt: str) -> str:
        out = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0
        )
        return out.choices[0].text

    async def ask_all() -> list[str]:
        try:
            return await asyncio.gather(*(ask(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(ask_all()) == expected


def test_n_choices_with_a_seed_are_reproducible(client):
    kwargs = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 8, "n": 3}
    first = client.completions.create(**kwargs, seed=7, temperature=1.0)
    again = client.completions.create(**kwargs, seed=7, temperature=1.0)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # different seeds per choice
    assert first.usage.completion_tokens == 24
    assert (
        first.usage.prompt_tokens
        == client.completions.create(
            model=MODEL, prompt="My favourite animal is", max_tokens=1
        ).usage.prompt_tokens
    )  # counted once, not n times


def test_several_prompts_in_one_request(client, reference):
    prompts = ["One, two,", "Red, green,"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.text for c in out.choices] == [greedy(reference, p, 5) for p in prompts]


def test_stop_string_is_cut_from_text_and_stream(client):
    prompt = "Count: 1, 2, 3, 4, 5,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text.strip()[2:5]  # a piece from the middle of the answer
    assert stop and stop in text
    cut = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_sparsity_extension_picks_a_pool(client):
    kwargs = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    sparse = client.completions.create(**kwargs)
    assert sparse.usage.prompt_tokens > 300
    assert sparse.model_extra["kvsparse"]["pool"] == "snapkv-64"
    assert sparse.model_extra["kvsparse"]["compression_ratio"] > 3

    dense = client.completions.create(**kwargs, extra_body={"kvsparse": {"policy": "dense"}})
    assert dense.model_extra["kvsparse"] == {"pool": "dense", "compression_ratio": 1.0}
    by_budget = client.completions.create(**kwargs, extra_body={"kvsparse": {"budget": 64}})
    assert by_budget.model_extra["kvsparse"]["pool"] == "snapkv-64"


@pytest.mark.parametrize(
    "options",
    [
        {"policy": "pyramid"},
        {"policy": "snapkv", "budget": 4096},
        {"budget": 64, "policy": "dense"},
    ],
)
def test_sparsity_extension_refuses_what_the_server_does_not_run(client, options):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"kvsparse": options}
        )
    assert err.value.body["param"] == "kvsparse"
    assert err.value.body["code"] == "unsupported_sparsity"
    assert "snapkv budget 64; dense" in err.value.body["message"]
