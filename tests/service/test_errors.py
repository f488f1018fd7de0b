"""Bad input, access and overload, answered with the right status and OpenAI's error body."""

from __future__ import annotations

import contextlib
import logging
import time

import httpx
import openai
import pytest

from tests.service.servers import BAD_REQUESTS, MODEL, BadRequest, check_refused, send


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=lambda c: c.name)
def test_bad_request_is_refused(real_server, case: BadRequest):
    check_refused(send(real_server, case), case)


def test_the_openai_client_sees_the_error(real_server):
    client = openai.OpenAI(base_url=real_server.v1, api_key=real_server.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4096)
    assert err.value.status_code == 400
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_a_refused_request_leaves_the_server_working(real_server):
    check_refused(send(real_server, BAD_REQUESTS[0]), BAD_REQUESTS[0])
    client = openai.OpenAI(base_url=real_server.v1, api_key=real_server.api_key, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-key", "Bearer test-key-and-more", "Basic dGVzdC1rZXk="]
)
def test_missing_or_wrong_api_key_is_401(real_server, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions")]:
        response = httpx.request(
            method, real_server.base_url + path, headers=headers,
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
        )  # fmt: skip
        assert response.status_code == 401
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")


def test_the_openai_client_with_a_wrong_key_is_refused(real_server):
    client = openai.OpenAI(base_url=real_server.v1, api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_health_and_metrics_need_no_key(real_server):
    assert httpx.get(real_server.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(real_server.base_url + "/metrics").status_code == 200


def test_unknown_path_is_404_in_openai_format(real_server):
    response = httpx.get(real_server.base_url + "/v1/engines")
    assert response.status_code == 404
    assert response.json()["error"]["message"]


def test_prompts_are_not_logged(real_server, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    secret = "zebra-umbrella-4711"
    client = openai.OpenAI(base_url=real_server.v1, api_key=real_server.api_key, max_retries=0)
    client.completions.create(model=MODEL, prompt=f"The password is {secret}.", max_tokens=2)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": secret}], max_tokens=2
    )
    out, err = capfd.readouterr()
    assert secret not in caplog.text + out + err


def test_body_over_the_limit_is_413(limits_server):
    body = {"model": "dummy:smollm2-135m", "prompt": "x" * 5000, "max_tokens": 1}
    response = httpx.post(limits_server.v1 + "/completions", json=body,
                          headers={"Authorization": f"Bearer {limits_server.api_key}"})  # fmt: skip
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while reading
        yield b'{"model": "dummy:smollm2-135m", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    headers = {"Authorization": f"Bearer {limits_server.api_key}",
               "Content-Type": "application/json"}  # fmt: skip
    response = httpx.post(limits_server.v1 + "/completions", content=chunks(), headers=headers)
    assert response.status_code == 413


def test_overload_is_429_with_retry_after_and_clears(limits_server):
    headers = {"Authorization": f"Bearer {limits_server.api_key}"}
    long = {"model": "dummy:smollm2-135m", "prompt": "Go", "max_tokens": 500, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(base_url=limits_server.v1, headers=headers, timeout=60) as client:
        with contextlib.ExitStack() as streams:
            lines = []  # kept: dropping an iterator closes its connection
            for _ in range(2):  # the server's limit
                response = streams.enter_context(client.stream("POST", "/completions", json=long))
                assert response.status_code == 200
                lines.append(response.iter_lines())
                assert next(lines[-1]).startswith("data: ")  # generating
            refused = client.post("/completions", json={**long, "stream": False})
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "server_overloaded"
        # The two clients went away: their requests were aborted and admission freed.
        deadline = time.monotonic() + 20
        while True:
            short = client.post("/completions", json={**long, "stream": False, "max_tokens": 2})
            if short.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert short.status_code == 200
        assert short.json()["usage"]["completion_tokens"] == 2
