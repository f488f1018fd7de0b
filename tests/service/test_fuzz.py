"""Request bodies generated around every field's edges and types (hypothesis), sent to a real
server of the real model while other clients stream: each is answered 2xx or 4xx (never 5xx, and
no stream ends in an error), no other client's stream fails, `/health` answers within 0.5 s, and
no KV block is left held.

The suite runs FUZZ_EXAMPLES examples (40); the long run of docs/serving.md sets
KVSPARSE_FUZZ_EXAMPLES=2000 (about 13 minutes on 2 cores) and prints how many requests got each
status: `KVSPARSE_FUZZ_EXAMPLES=2000 pytest -s tests/service/test_fuzz.py`."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.settings import parse_pools
from sparse_core import EngineConfig
from tests.service.servers import MODEL, SPARSE, Server, metric_sum, standalone, wait_for

FUZZ_EXAMPLES = int(os.environ.get("KVSPARSE_FUZZ_EXAMPLES", "40"))
pytestmark = pytest.mark.timeout(max(900, 3 * FUZZ_EXAMPLES))  # the long run takes its time
HEALTH_LATENCY_S = 0.5
MAX_MODEL_LEN = 128  # every request that is served ends within this many tokens

INTS = st.sampled_from(
    [-(2**64), -(2**63) - 1, -(2**63), -(2**31), -2, -1, 0, 1, 2, 3, 16, 17, 127, 128, 49151,
     49152, 2**31, 2**63 - 1, 2**63, 2**64]
) | st.integers(-3, 40)  # fmt: skip
FLOATS = st.sampled_from(
    [0.0, -0.0, 1e-300, 1e-45, 1e-6, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, -2.0, -2.5, 1e300,
     math.nan, math.inf, -math.inf]
) | st.floats(-3, 3)  # fmt: skip
WRONG = st.sampled_from([None, True, False, "", "5", [], {}, [1], {"a": 1}, 0.5])
TEXT = st.text(max_size=30) | st.sampled_from(["\x00", "\ud800", "<|im_end|>", "a" * 5000])
NUMBER = FLOATS | INTS | WRONG
TOKEN_IDS = st.lists(INTS, max_size=6)
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]) | WRONG},
                             optional={"text": TEXT | WRONG})  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]) | WRONG},
    optional={"content": TEXT | st.lists(PART, max_size=3) | WRONG, "name": TEXT | WRONG},
)  # fmt: skip
FIELDS = {
    "model": st.just(MODEL) | TEXT | WRONG,
    "max_tokens": INTS | WRONG,
    "max_completion_tokens": INTS | WRONG,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": INTS | WRONG,
    "seed": INTS | WRONG,
    "n": st.integers(-1, 17) | WRONG,
    "min_tokens": INTS | WRONG,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "repetition_penalty": NUMBER,
    "stop": TEXT | st.lists(TEXT, max_size=4) | st.lists(st.just("x"), min_size=65, max_size=70)
    | WRONG,
    "stop_token_ids": TOKEN_IDS | WRONG,
    "ignore_eos": st.booleans() | WRONG,
    "stream": st.booleans() | WRONG,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | WRONG}) | WRONG,
    "user": TEXT | WRONG,
    "logprobs": st.sampled_from([None, False, True, 0, 2, 20, 21]) | INTS | WRONG,
    "top_logprobs": INTS | WRONG,
    "echo": st.booleans() | WRONG,
    "best_of": st.integers(-1, 3) | WRONG,
    "kvsparse": st.fixed_dictionaries({}, optional={"policy": TEXT | st.just("dense"),
                                                    "budget": INTS | WRONG}) | WRONG,
}  # fmt: skip
PROMPT = TEXT | TOKEN_IDS | st.lists(TEXT | TOKEN_IDS, max_size=3) | WRONG
MESSAGES = st.lists(MESSAGE, max_size=3) | WRONG
# A request that is served, and one to three of its fields (or fields it lacks) set at an edge.
VALID = {"/completions": {"model": MODEL, "prompt": "Tell me", "max_tokens": 8},
         "/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                               "max_tokens": 8}}  # fmt: skip
EDGES = {**FIELDS, "prompt": PROMPT, "messages": MESSAGES}


def _edges(names: list[str]) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({name: EDGES[name] for name in names})


REQUESTS = st.tuples(
    st.sampled_from(list(VALID)),
    st.lists(st.sampled_from(list(EDGES)), min_size=1, max_size=3, unique=True).flatmap(_edges),
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    engine = EngineConfig(model=MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
                          kv_cache_memory_gb=0.1)  # fmt: skip
    with standalone(engine, parse_pools("snapkv,dense", SPARSE)) as server:
        yield server


class Background:
    """Other clients meanwhile: streams started one after another, and /health polled."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.stream_failures: list[str] = []
        self.streams_finished = 0
        self.slowest_health = 0.0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._streams) for _ in range(2)]
        self._threads.append(threading.Thread(target=self._health))
        for thread in self._threads:
            thread.start()

    def _streams(self) -> None:
        body = {"model": MODEL, "prompt": "The weather today", "max_tokens": 24,
                "ignore_eos": True, "stream": True}  # fmt: skip
        headers = {"Authorization": f"Bearer {self.server.api_key}"}
        while not self._stop.is_set():
            with httpx.stream("POST", self.server.v1 + "/completions", json=body,
                              headers=headers, timeout=120) as response:  # fmt: skip
                if response.status_code != 200:
                    self.stream_failures.append(f"status {response.status_code}")
                    continue
                events = [line for line in response.iter_lines() if line.startswith("data: {")]
            last = json.loads(events[-1].removeprefix("data: "))
            if "error" in last or last["choices"][0]["finish_reason"] != "length":
                self.stream_failures.append(json.dumps(last))
            else:
                self.streams_finished += 1

    def _health(self) -> None:
        with httpx.Client(base_url=self.server.base_url, timeout=30) as client:
            while not self._stop.wait(0.05):
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                self.slowest_health = max(self.slowest_health, time.monotonic() - start)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def check_answer(response: httpx.Response, streamed: bool) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", error
        return
    assert response.status_code == 200
    if not streamed:
        assert response.json()["choices"], response.text
        return
    events = [line.removeprefix("data: ") for line in response.text.splitlines()
              if line.startswith("data: ")]  # fmt: skip
    assert events[-1] == "[DONE]"
    assert not any('"error"' in event[:12] for event in events), events[-3:]


def test_fuzzed_requests_are_answered_alone(server):
    background = Background(server)
    headers = {"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"}
    client = httpx.Client(timeout=120)
    statuses: list[int] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(REQUESTS)
    def send(request: tuple[str, dict]) -> None:
        path, edges = request
        body = {**VALID[path], **edges}
        content = json.dumps(body)  # NaN and Infinity as JavaScript writes them
        response = client.post(server.v1 + path, content=content, headers=headers)
        check_answer(response, body.get("stream") is True)
        statuses.append(response.status_code)

    try:
        send()
    finally:
        background.stop()
        client.close()
    print(f"fuzzed requests by status: {sorted(Counter(statuses).items())}")
    assert not background.stream_failures, background.stream_failures[:3]
    assert background.streams_finished > 0
    assert background.slowest_health < HEALTH_LATENCY_S, background.slowest_health
    wait_for(lambda: metric_sum(server.metrics(), "kvsparse_kv_blocks_used") == 0)
