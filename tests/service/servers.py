"""Helpers of the serving tests: real engines behind real HTTP (uvicorn on a free port)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import uvicorn

from service.settings import PoolSpec, ServerSettings
from service.standalone import build_standalone_app
from sparse_core import EngineConfig, SparsityConfig

API_KEY = "test-key"
# Ray Serve LLM's prefix-aware request router (its public path needs pyarrow), for
# `request_router_class`.
PREFIX_CACHE_AFFINITY_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
    ":PrefixCacheAffinityRouter"
)
MODEL = "smollm2-135m-instruct"
# Compresses prompts longer than 64 tokens in all but the first two layers.
SPARSE = SparsityConfig(policy="snapkv", budget=64, window=16, sinks=4, full_layers=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str | None

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text


@contextlib.contextmanager
def run_server(app, api_key: str | None) -> Iterator[Server]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield Server(f"http://127.0.0.1:{port}", api_key)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@dataclass
class ServeProcess:
    """`kvsparse serve ARGS` as a user runs it: a process of its own, its output in a file."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115
        command = [sys.executable, "-m", "service.cli", "serve", *self.args,
                   "--port", str(self.port)]  # fmt: skip
        self.process = subprocess.Popen(command, env={**os.environ, **self.env},
                                        stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_healthy(self, timeout: float = 120) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, self.output()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return self
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self.log.close()


def standalone(
    engine: EngineConfig,
    pools: list[SparsityConfig],
    api_key: str | None = API_KEY,
    **limits: int,
) -> contextlib.AbstractContextManager[Server]:
    settings = ServerSettings(
        served_model_names=[engine.model],
        max_model_len=engine.max_model_len,
        pools=[PoolSpec.of(p) for p in pools],
        api_key=api_key,
        **limits,
    )
    return run_server(build_standalone_app(engine, pools, settings), api_key)


def metric_values(text: str, name: str, **labels: str) -> list[float]:
    """Samples of a metric in Prometheus text format whose labels include `labels`."""
    values = []
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{(.*)\}})? (\S+)$", line)
        if not match:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            values.append(float(match.group(3)))
    return values


def metric_sum(text: str, name: str, **labels: str) -> float:
    return sum(metric_values(text, name, **labels))


def wait_for(condition, timeout: float = 20.0, interval: float = 0.2):
    """Poll until `condition()` is truthy; returns its value or fails."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


@dataclass
class BadRequest:
    """A request the server must refuse: path, body, expected status, `param` and `code`."""

    name: str
    path: str
    body: dict | bytes
    status: int
    param: str | None
    code: str | None
    content_type: str = "application/json"  # of a body given as bytes


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], **fields}


# For a server of MODEL with max_model_len 1024.
BAD_REQUESTS = [
    BadRequest("malformed JSON", "/v1/completions", b'{"model": "x", "prompt": ', 400, None,
               "invalid_json"),
    BadRequest("body not an object", "/v1/chat/completions", b"[1, 2]", 400, None, "invalid_json"),
    BadRequest("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt",
               "missing_required_parameter"),
    BadRequest("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages",
               "missing_required_parameter"),
    BadRequest("missing model", "/v1/completions", {"prompt": "Hello"}, 400, "model",
               "missing_required_parameter"),
    BadRequest("max_tokens as a string", "/v1/completions", _completion(max_tokens="5"), 400,
               "max_tokens", "invalid_type"),
    BadRequest("temperature as a string", "/v1/chat/completions", _chat(temperature="hot"), 400,
               "temperature", "invalid_type"),
    BadRequest("messages not a list", "/v1/chat/completions", {"model": MODEL, "messages": "hi"},
               400, "messages", "invalid_type"),
    BadRequest("unknown role", "/v1/chat/completions",
               {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400,
               "messages", "invalid_type"),
    BadRequest("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400,
               "messages", "invalid_value"),
    BadRequest("empty prompt", "/v1/completions", _completion(prompt=""), 400, "prompt", None),
    BadRequest("max_tokens 0", "/v1/completions", _completion(max_tokens=0), 400, "max_tokens",
               "invalid_value"),
    BadRequest("max_tokens negative", "/v1/chat/completions", _chat(max_tokens=-3), 400,
               "max_tokens", "invalid_value"),
    BadRequest("max_tokens beyond the context", "/v1/completions", _completion(max_tokens=1024),
               400, "max_tokens", "context_length_exceeded"),
    BadRequest("chat max_tokens beyond the context", "/v1/chat/completions",
               _chat(max_tokens=5000), 400, "max_tokens", "context_length_exceeded"),
    BadRequest("prompt longer than max_model_len", "/v1/completions",
               _completion(prompt="word " * 1100), 400, "prompt", "context_length_exceeded"),
    BadRequest("chat longer than max_model_len", "/v1/chat/completions",
               {"model": MODEL, "messages": [{"role": "user", "content": "word " * 1100}]}, 400,
               "messages", "context_length_exceeded"),
    BadRequest("token id outside the vocabulary", "/v1/completions",
               _completion(prompt=[1, 2, 10**7]), 400, "prompt", None),
    BadRequest("unknown model", "/v1/completions", _completion(model="gpt-4"), 404, "model",
               "model_not_found"),
    BadRequest("unsupported parameter", "/v1/completions", _completion(logprobs=2, echo=True),
               400, "echo", "unsupported_parameter"),
    BadRequest("logprobs beyond 20", "/v1/completions", _completion(logprobs=21), 400,
               "logprobs", "invalid_value"),
    BadRequest("top_logprobs without logprobs", "/v1/chat/completions", _chat(top_logprobs=2),
               400, "top_logprobs", "invalid_value"),
    BadRequest("top_p out of range", "/v1/completions", _completion(top_p=0), 400, "top_p",
               "invalid_value"),
    BadRequest("too many choices", "/v1/completions", _completion(n=100), 400, "n",
               "invalid_value"),
    BadRequest("top_k beyond int64", "/v1/completions", _completion(top_k=2**63), 400, "top_k",
               "invalid_value"),
    BadRequest("stop token id outside the vocabulary", "/v1/chat/completions",
               _chat(stop_token_ids=[10**12], min_tokens=1), 400, "stop_token_ids",
               "invalid_value"),
    BadRequest("too many stop strings", "/v1/completions",
               _completion(stop=[str(i) for i in range(1000)]), 400, "stop", "invalid_value"),
    BadRequest("a form body", "/v1/completions", b"model=x&prompt=hi", 415, None,
               "unsupported_media_type", content_type="application/x-www-form-urlencoded"),
]  # fmt: skip


def check_refused(response: httpx.Response, case: BadRequest) -> None:
    """Status and OpenAI error body as expected."""
    assert response.status_code == case.status, (case.name, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"], case.name
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (case.param, case.code), (case.name, error)


def send(server: Server, case: BadRequest, api_key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {api_key or server.api_key}"}
    if isinstance(case.body, bytes):
        headers["Content-Type"] = case.content_type
        return httpx.post(
            server.base_url + case.path, content=case.body, headers=headers, timeout=60
        )
    return httpx.post(server.base_url + case.path, json=case.body, headers=headers, timeout=60)


def abandon_request(url: str, body: dict, headers: dict, generating) -> None:
    """POST a (non-streaming) request and close the connection once `generating()` is true."""

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            task = asyncio.create_task(client.post(url, json=body, headers=headers))
            await asyncio.to_thread(wait_for, lambda: task.done() or generating(), 60)
            assert not task.done(), task.result().text  # still waiting for the answer
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(run())


# Ray waits a fixed 30 s for a new node's raylet to register; on a loaded 2-core machine the
# first start can miss it, and a second start (warm page cache) does not.
RAY_START_ATTEMPTS = 3


@dataclass
class RayApp:
    v1: str  # http://127.0.0.1:PORT/v1
    metrics_address: str | None  # 127.0.0.1:PORT of Ray's Prometheus endpoint, when asked for


def _start_ray(metrics_port: int | None) -> None:
    import ray

    options: dict = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
    if metrics_port is not None:
        options["_metrics_export_port"] = metrics_port
        options["_system_config"] = {"metrics_report_interval_ms": 1000}  # default 10 s
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(**options)
            return
        except Exception as error:  # Ray raises a bare Exception for this
            ray.shutdown()
            if "timed out during startup" not in str(error) or attempt == RAY_START_ATTEMPTS:
                raise


@contextlib.contextmanager
def ray_serve_app(args: dict, name: str, with_metrics: bool = False) -> Iterator[RayApp]:
    """The application on a fresh local Ray cluster, built as `serve run` / `serve deploy` build
    it from a config file's import_path and args (what the Helm chart deploys)."""
    import ray
    from ray import serve
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    metrics_port = free_port() if with_metrics else None
    http_port = free_port()
    _start_ray(metrics_port)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        builder = import_attr("service.ray_app:build_app")
        serve.run(call_user_app_builder_with_args_if_necessary(builder, args), name=name)
        metrics = f"127.0.0.1:{metrics_port}" if metrics_port is not None else None
        yield RayApp(f"http://127.0.0.1:{http_port}/v1", metrics)
    finally:
        serve.shutdown()
        ray.shutdown()


def chat_cache_hits(
    v1: str, tokenizer, conversations: int = 6, turns: int = 3
) -> tuple[int, int, int]:
    """Chats at once, each turn sending the conversation so far (a ~300-token document first)
    with greedy 8-token answers: (prompt tokens, cached tokens as the responses report them,
    cached tokens one replica would have found: every earlier turn's full 16-token blocks)."""
    client = openai.AsyncOpenAI(base_url=v1, api_key=API_KEY, max_retries=0)

    async def chat(c: int) -> list[tuple[int, int, int]]:
        document = f"Document {c}. " + " ".join(
            f"Fact {c}.{i}: the value of item {i} is {i * (c + 3)}." for i in range(20)
        )
        messages = [{"role": "system", "content": document}]
        previous: list[int] = []
        counts = []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"What is the value of item {turn}?"})
            out = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
            ids = tokenizer.encode_chat(messages)
            common = next((i for i, (a, b) in enumerate(zip(ids, previous, strict=False)) if a != b),
                          min(len(ids), len(previous)))  # fmt: skip
            usage = out.usage
            counts.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                           common // 16 * 16))  # fmt: skip
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
            previous = ids
        return counts

    async def chat_all() -> list[list[tuple[int, int, int]]]:
        try:
            return await asyncio.gather(*(chat(c) for c in range(conversations)))
        finally:
            await client.close()

    counts = [t for conversation in asyncio.run(chat_all()) for t in conversation]
    return tuple(sum(column) for column in zip(*counts, strict=True))  # type: ignore[return-value]
