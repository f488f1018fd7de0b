"""`logprobs` (completions) and `logprobs` / `top_logprobs` (chat) through the real server with
the official client: OpenAI's shapes, the chosen token always present, the top lists sorted and
as long as asked, the engine's values, and a stream's chunks carrying their own tokens'
logprobs, which together are the whole answer's."""

from __future__ import annotations

import openai
import pytest

from sparse_core import SamplingParams
from tests.service.servers import MODEL

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"model": MODEL, "max_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.v1, api_key=real_server.api_key, max_retries=0)


def completion_logprobs(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[dict, str]:
    """The answer's `logprobs` as a dict of its four lists (a stream's chunks joined, each
    checked to carry as many logprobs as tokens), and its text."""
    if not stream:
        choice = client.completions.create(prompt=PROMPT, **kwargs).choices[0]
        return choice.logprobs.model_dump(), choice.text
    joined: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    extra = {**kwargs.pop("extra_body", {}), "return_token_ids": True}
    for chunk in client.completions.create(prompt=PROMPT, stream=True, extra_body=extra, **kwargs):
        choice = chunk.choices[0]
        text += choice.text
        assert len(choice.logprobs.tokens) == len(choice.token_ids)
        for name, values in choice.logprobs.model_dump().items():
            joined[name] += values
    return joined, text


def chat_logprobs(client: openai.OpenAI, stream: bool, **kwargs) -> list[dict]:
    """The answer's `logprobs.content` (a stream's chunks joined, each checked to carry as many
    logprobs as tokens)."""
    if not stream:
        choice = client.chat.completions.create(messages=MESSAGES, **kwargs).choices[0]
        return [entry.model_dump() for entry in choice.logprobs.content]
    content = []
    chunks = client.chat.completions.create(messages=MESSAGES, stream=True,
                                            extra_body={"return_token_ids": True}, **kwargs)  # fmt: skip
    for chunk in chunks:
        choice = chunk.choices[0]
        if choice.logprobs is None:
            assert choice.delta.role == "assistant"  # the opening chunk only
            continue
        assert len(choice.logprobs.content) == len(choice.token_ids)
        content += [entry.model_dump() for entry in choice.logprobs.content]
    return content


def check_sorted(values: list[float], length: int) -> None:
    assert len(values) == length
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs(client, dense_llm, stream):
    logprobs, text = completion_logprobs(client, stream, logprobs=5, **GREEDY)
    tokens, chosen = logprobs["tokens"], logprobs["token_logprobs"]
    assert len(tokens) == len(chosen) == len(logprobs["top_logprobs"]) == 10
    assert "".join(tokens) == text
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for token, logprob, top in zip(tokens, chosen, logprobs["top_logprobs"], strict=True):
        check_sorted(list(top.values()), 5)
        assert top[token] == logprob == max(top.values())  # greedy: the most likely
    # The engine's own values, the same as the server's through HTTP.
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=5)
    expected = dense_llm.generate(PROMPT, params)[0]
    token_text = dense_llm.tokenizer.token_text
    assert tokens == [token_text(t) for t in expected.token_ids]
    assert chosen == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert [list(top) for top in logprobs["top_logprobs"]] == [
        [token_text(t) for t, _ in e.top] for e in expected.logprobs
    ]


def test_a_completion_stream_has_the_whole_answers_logprobs(client):
    whole, whole_text = completion_logprobs(client, False, logprobs=3, **GREEDY)
    streamed, streamed_text = completion_logprobs(client, True, logprobs=3, **GREEDY)
    assert streamed_text == whole_text
    assert (streamed["tokens"], streamed["text_offset"]) == (whole["tokens"], whole["text_offset"])
    assert [list(top) for top in streamed["top_logprobs"]] == [
        list(t) for t in whole["top_logprobs"]
    ]
    for name in ("token_logprobs", "top_logprobs"):
        assert numbers(streamed[name]) == pytest.approx(numbers(whole[name]), abs=1e-5)


def numbers(logprobs: list[float] | list[dict[str, float]]) -> list[float]:
    return [v for x in logprobs for v in (x.values() if isinstance(x, dict) else [x])]


def test_the_chosen_token_is_among_the_top_logprobs_even_when_not_the_most_likely(client):
    kwargs = {"model": MODEL, "max_tokens": 20, "temperature": 2.0, "seed": 4}
    logprobs, _ = completion_logprobs(client, False, logprobs=1, **kwargs)
    tops = logprobs["top_logprobs"]
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops,
                                   strict=True):  # fmt: skip
        assert top[token] == logprob and len(top) in (1, 2)
    assert any(len(top) == 2 for top in tops), "every token drawn was the most likely"
    # 0: the chosen token's alone.
    only, _ = completion_logprobs(client, False, logprobs=0, **GREEDY)
    assert only["top_logprobs"] == [
        {t: lp} for t, lp in zip(only["tokens"], only["token_logprobs"], strict=True)
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(client, stream):
    content = chat_logprobs(client, stream, logprobs=True, top_logprobs=4, **GREEDY)
    assert len(content) == 10
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        check_sorted([t["logprob"] for t in top], 4)
        assert all(t["bytes"] == list(t["token"].encode()) for t in top)
        # Greedy: the chosen token is the most likely.
        assert (entry["token"], entry["logprob"]) == (top[0]["token"], top[0]["logprob"])


def test_a_chat_stream_has_the_whole_answers_logprobs(client):
    whole = chat_logprobs(client, False, logprobs=True, top_logprobs=2, **GREEDY)
    streamed = chat_logprobs(client, True, logprobs=True, top_logprobs=2, **GREEDY)
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    values = [[e["logprob"], *(t["logprob"] for t in e["top_logprobs"])] for e in whole]
    assert [[e["logprob"], *(t["logprob"] for t in e["top_logprobs"])] for e in streamed] == [
        pytest.approx(v, abs=1e-5) for v in values
    ]


def test_chat_logprobs_without_top_logprobs_and_answers_that_ask_for_none(client):
    content = chat_logprobs(client, False, logprobs=True, **GREEDY)
    assert len(content) == 10 and all(e["top_logprobs"] == [] for e in content)
    assert client.chat.completions.create(messages=MESSAGES, **GREEDY).choices[0].logprobs is None
    assert client.completions.create(prompt=PROMPT, **GREEDY).choices[0].logprobs is None
    # n choices: each its own.
    out = client.completions.create(prompt=PROMPT, n=2, logprobs=1, **GREEDY)
    assert [len(c.logprobs.tokens) for c in out.choices] == [10, 10]
