"""Requests an attacker would send, each answered alone: refused with an OpenAI error before it
reaches a step, while other clients' streams run on and finish."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.service.servers import MODEL

BYSTANDER = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60,
             "ignore_eos": True, "stream": True}  # fmt: skip
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}


def headers(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_key}"}


class Bystanders:
    """Streams started before a hostile request and read to their end meanwhile."""

    def __init__(self, server, count: int = 3) -> None:
        self.server = server
        self.finish_reasons: list[str | None] = [None] * count
        self.started = threading.Barrier(count + 1)
        self.threads = [threading.Thread(target=self._stream, args=(i,)) for i in range(count)]
        for thread in self.threads:
            thread.start()
        self.started.wait(timeout=60)

    def _stream(self, index: int) -> None:
        with httpx.stream("POST", self.server.v1 + "/completions", json=BYSTANDER,
                          headers=headers(self.server), timeout=120) as response:  # fmt: skip
            lines = response.iter_lines()
            first = next(lines)
            self.started.wait(timeout=60)
            for line in [first, *lines]:
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        self.finish_reasons[index] = "error: " + event["error"]["message"]
                        return
                    reason = event["choices"][0]["finish_reason"]
                    self.finish_reasons[index] = reason or self.finish_reasons[index]

    def join(self) -> list[str | None]:
        for thread in self.threads:
            thread.join(timeout=120)
        return self.finish_reasons


# Each made every request of its engine step fail, or slowed every other request down.
BEYOND_THE_MODEL = [
    ({"top_k": 2**63}, "top_k"), ({"top_k": 49153}, "top_k"),
    ({"stop_token_ids": [10**12], "min_tokens": 2}, "stop_token_ids"),
    ({"stop_token_ids": [-(10**8)], "min_tokens": 2}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": [f"stop{i}" for i in range(300_000)]}, "stop"),
    ({"stop": "x" * 5000}, "stop"),
]  # fmt: skip


def test_fields_beyond_the_model_are_400s_and_other_streams_finish(real_server):
    bystanders = Bystanders(real_server)
    for fields, param in BEYOND_THE_MODEL:
        response = httpx.post(real_server.v1 + "/completions", json={**COMPLETION, **fields},
                              headers=headers(real_server), timeout=60)  # fmt: skip
        assert response.status_code == 400, (param, response.text)
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_value"), error
    assert bystanders.join() == ["length"] * 3


def test_top_k_minus_one_is_off_as_in_vllm(real_server):
    body = {**COMPLETION, "temperature": 0, "max_tokens": 8}
    plain = httpx.post(real_server.v1 + "/completions", json=body,
                       headers=headers(real_server), timeout=60)  # fmt: skip
    off = httpx.post(real_server.v1 + "/completions", json={**body, "top_k": -1},
                     headers=headers(real_server), timeout=60)  # fmt: skip
    assert off.status_code == 200, off.text
    assert off.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(real_server):
    """1e-300 rounds to 0 in float32: the draw is then the greedy token, not the last id."""
    body = {**COMPLETION, "max_tokens": 8, "ignore_eos": True}
    greedy = httpx.post(real_server.v1 + "/completions", json={**body, "temperature": 0},
                        headers=headers(real_server), timeout=60)  # fmt: skip
    tiny = httpx.post(real_server.v1 + "/completions", json={**body, "top_p": 1e-300, "seed": 1},
                      headers=headers(real_server), timeout=60)  # fmt: skip
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
def test_a_body_that_is_not_declared_json_is_a_415(real_server, content_type):
    """A web page can POST text/plain or a form to a local server without asking first; only a
    JSON content type reaches the engines."""
    sent = {**headers(real_server)}
    if content_type is not None:
        sent["Content-Type"] = content_type
    response = httpx.post(real_server.v1 + "/completions", content=json.dumps(COMPLETION),
                          headers=sent, timeout=60)  # fmt: skip
    assert response.status_code == 415, response.text
    assert response.json()["error"]["code"] == "unsupported_media_type"
    sent["Content-Type"] = "Application/JSON; charset=utf-8"
    response = httpx.post(real_server.v1 + "/completions", content=json.dumps(COMPLETION),
                          headers=sent, timeout=60)  # fmt: skip
    assert response.status_code == 200, response.text


def test_the_largest_stop_lists_allowed_do_not_hold_back_other_requests(real_server):
    """At the bounds (64 stop strings, 4096 characters), four such requests beside a short
    greedy one: it answers in about the time it takes alone."""
    stops = [f"{i:03d}" + "q" * 60 for i in range(64)]
    body = {**COMPLETION, "max_tokens": 20, "temperature": 0, "ignore_eos": True}

    def timed() -> float:
        start = time.monotonic()
        response = httpx.post(real_server.v1 + "/completions", json=body,
                              headers=headers(real_server), timeout=60)  # fmt: skip
        assert response.status_code == 200
        return time.monotonic() - start

    alone = min(timed() for _ in range(2))
    heavy = {**body, "max_tokens": 40, "stop": stops}
    threads = [
        threading.Thread(target=httpx.post, args=(real_server.v1 + "/completions",),
                         kwargs={"json": heavy, "headers": headers(real_server), "timeout": 120})
        for _ in range(4)
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    beside = timed()
    for thread in threads:
        thread.join()
    assert beside < 3 * alone + 1.0, (alone, beside)
