"""No request may hold the server's event loop: while the largest prompts a client may send are
refused or tokenized, `/health` (a Kubernetes liveness probe) keeps answering at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.service.servers import MODEL

HEALTH_LATENCY_S = 0.5
# Just under the 4 MiB body limit (2 bytes per repetition).
HUGE_TEXT = "a " * (2 * 2**20 - 100)


def health_latencies_while(server, send_all) -> tuple[list[float], list[httpx.Response]]:
    """`send_all()` in a thread; /health polled meanwhile: its latencies and send_all's result."""
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.extend(send_all()))
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        client.get("/health")  # a connection ready
        thread.start()
        while thread.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    thread.join()
    return latencies, result


def test_health_answers_while_the_largest_prompts_are_refused_or_tokenized(real_server):
    headers = {"Authorization": f"Bearer {real_server.api_key}"}
    # A prompt the size of the body limit, as text and as chat; and several prompts of the
    # longest text that could still fit the context (bound by size), tokenized at once.
    per_token = 81  # SmolLM2's longest vocabulary entry, in characters
    longest = "a " * (1024 * per_token // 2 - 8)

    def chat(text: str) -> tuple[str, dict]:
        messages = [{"role": "user", "content": text}]
        return "/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": messages}

    bodies = [("/completions", {"model": MODEL, "prompt": HUGE_TEXT, "max_tokens": 1})]
    bodies += [chat(HUGE_TEXT)] + [chat(longest)] * 6

    def send_all() -> list[httpx.Response]:
        def post(path_body: tuple[str, dict]) -> httpx.Response:
            path, body = path_body
            return httpx.post(real_server.v1 + path, json=body, headers=headers, timeout=120)

        with ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(post, bodies))

    latencies, responses = health_latencies_while(real_server, send_all)
    for response in responses:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
    assert "characters" in responses[0].json()["error"]["message"]  # refused by its size
    assert len(latencies) >= 3
    assert max(latencies) < HEALTH_LATENCY_S, sorted(latencies)[-5:]
