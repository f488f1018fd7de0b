"""The clients of `kvsparse bench serve`: streaming requests through the official `openai`
client, sent from processes of their own.

A load generator must not be what limits the server it measures. The `openai` client spends
CPU on each streamed chunk, and 40 clients of a server that steps every few milliseconds
receive thousands of chunks a second: in one event loop they fell behind the server
(docs/benchmarks.md, "Engine internals"), which delayed every client's next request and starved the
engine. The clients are therefore spread over processes, each with its own event loop and
`openai` client, started together at each load level.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

# A process keeps up with this many streaming clients with room to spare (~0.2 s of CPU per
# second at one chunk per client every 6 ms).
CLIENTS_PER_PROCESS = 10
JOIN_TIMEOUT_S = 10.0


@dataclass
class RequestResult:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    prompt_tokens: int
    start_s: float = 0.0  # when it was sent, from the start of its level
    client: int = 0  # closed loop: which client sent it; open loop: its arrival order
    round: int = 0  # which of its client's requests (0 = the first, sent by all clients at once)
    process: int = 0  # which load generator process sent it
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (0 if not reported)
    turn: int = 0  # of its conversation (0: the first)
    # With ClientSettings.return_token_ids: the generated token ids.
    token_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class ClientSettings:
    base_url: str
    api_key: str
    model: str
    output_len: int
    timeout: float
    # Ask for the generated ids (vLLM's return_token_ids): a conversation's next turn sends them
    # back as the server's answer.
    return_token_ids: bool = False

    def client(self):
        from openai import AsyncOpenAI  # the bench extra's: not imported by `kvsparse serve`

        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0,
                           timeout=self.timeout)  # fmt: skip


@dataclass
class ClientJob:
    """One client's requests, each sent when the one before it has finished, the first `at`
    seconds after the level starts (closed loop: every client at 0; open loop: one request
    each, at its arrival time).

    Multi-turn (`follow_ups`, one list per prompt): each prompt opens a conversation, and each
    of its follow-ups is a user turn sent after it as a chat client sends it: the conversation
    so far (the previous turn's prompt and the server's answer to it, as token ids) followed by
    the new turn's tokens."""

    client: int
    prompts: list[list[int]]
    at: float = 0.0
    follow_ups: list[list[list[int]]] = field(default_factory=list)

    def turns(self, index: int) -> list[list[int]]:
        return self.follow_ups[index] if self.follow_ups else []


@dataclass
class JobsDone:
    results: list[RequestResult]
    errors: list[str]
    end_s: float  # when the last request ended, from the level's start


async def one_request(
    client, model: str, prompt: list[int], output_len: int, return_token_ids: bool = False
) -> RequestResult:
    start = time.perf_counter()
    ttft = None
    usage = None
    token_ids: list[int] = []
    extra = {"return_token_ids": True} if return_token_ids else {}
    stream = await client.completions.create(
        model=model,
        # The token ids go in extra_body, which the client sends as is: as `prompt` it would
        # walk every id through its parameter transform first, a cost in this process's CPU per
        # request, paid one request after another when a round of clients sends together.
        # The request on the wire is the same.
        prompt=[],
        max_tokens=output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"prompt": prompt, "ignore_eos": True, **extra},
    )
    async for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - start
        if return_token_ids and chunk.choices:
            token_ids += getattr(chunk.choices[0], "token_ids", None) or []
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - start
    if usage is None:
        raise RuntimeError("the server sent no usage (stream_options.include_usage)")
    if return_token_ids and len(token_ids) != usage.completion_tokens:
        raise RuntimeError(
            f"the server returned {len(token_ids)} token ids for {usage.completion_tokens} "
            f"tokens: multi-turn needs vLLM's return_token_ids (vllm serve, kvsparse serve)"
        )
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) or 0
    return RequestResult(ttft if ttft is not None else e2e, e2e, usage.completion_tokens,
                         usage.prompt_tokens, cached_tokens=cached,
                         token_ids=token_ids)  # fmt: skip


# The `openai` client keeps at most this many idle connections open.
WARM_CONNECTIONS_MAX = 100
WARM_UP_TIMEOUT_S = 10.0


async def warm_up(client, connections: int) -> None:
    """Make the client's first calls before a level starts, so that its requests do not pay for
    them: a process's first call sets the `openai` client up (far slower than the calls after
    it) and each concurrent one opens a connection. Failures (a server that
    refuses or does not answer within WARM_UP_TIMEOUT_S) are left to the level's requests to
    report."""
    calls = min(connections, WARM_CONNECTIONS_MAX)
    await asyncio.gather(
        *(client.models.list(timeout=WARM_UP_TIMEOUT_S) for _ in range(calls)),
        return_exceptions=True,
    )


async def run_jobs(
    client, settings: ClientSettings, jobs: list[ClientJob], start_at: float
) -> JobsDone:
    """Every job's requests, timed from `start_at` (Unix time: the processes of a level share
    it); a request that fails is counted as an error and its client goes on (with its next
    conversation, in multi-turn)."""
    results: list[RequestResult] = []
    errors: list[str] = []

    async def run(job: ClientJob) -> None:
        await asyncio.sleep(max(0.0, start_at + job.at - time.time()))
        round = 0
        for index, first in enumerate(job.prompts):
            prompt, answer = first, []
            for turn, user_tokens in enumerate([[], *job.turns(index)]):
                prompt = prompt + answer + user_tokens  # the conversation so far, the new turn
                start_s = time.time() - start_at
                try:
                    result = await one_request(client, settings.model, prompt,
                                               settings.output_len,
                                               settings.return_token_ids)  # fmt: skip
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    round += len(job.turns(index)) + 1 - turn
                    break  # a conversation without its answer cannot go on
                answer, result.token_ids = result.token_ids, []  # not sent to the parent
                result.start_s, result.client, result.round = start_s, job.client, round
                result.turn = turn
                round += 1
                results.append(result)

    await asyncio.gather(*(run(job) for job in jobs))
    return JobsDone(results, errors, time.time() - start_at)


class ClientProcesses:
    """Processes that run a level's client jobs together, for one benchmark."""

    def __init__(self, count: int, settings: ClientSettings) -> None:
        context = mp.get_context("spawn")  # no copy of the caller's event loop or connections
        self._conns: list[Connection] = []
        self._processes: list[mp.process.BaseProcess] = []
        for i in range(count):
            conn, child_conn = context.Pipe()
            process = context.Process(
                target=_process_main, args=(child_conn, settings), name=f"kvsparse-bench-{i}",
                daemon=True,
            )  # fmt: skip
            process.start()
            child_conn.close()
            self._conns.append(conn)
            self._processes.append(process)

    def run(self, jobs: list[ClientJob]) -> tuple[float, JobsDone]:
        """Run `jobs`, dealt out over the processes in turn; (the level's start as Unix time,
        what they all did). The level starts once every process has its client ready."""
        count = len(self._conns)
        for i, conn in enumerate(self._conns):
            self._call(conn.send, jobs[i::count])
        for conn in self._conns:
            self._call(conn.recv)  # ready
        start_at = time.time()
        for conn in self._conns:
            self._call(conn.send, start_at)
        done: list[JobsDone] = []
        for i, conn in enumerate(self._conns):
            part = self._call(conn.recv)
            for result in part.results:
                result.process = i
            done.append(part)
        return start_at, JobsDone(
            [r for d in done for r in d.results],
            [e for d in done for e in d.errors],
            max(d.end_s for d in done),
        )

    @staticmethod
    def _call(method, *args):
        try:
            return method(*args)
        except (EOFError, OSError):
            raise RuntimeError("a load generator process exited; its error is above") from None

    def close(self, stop_now: bool = False) -> None:
        """Stop the processes: after the level in hand, or at once (`stop_now`: the benchmark
        failed or was interrupted, and what they do is no longer wanted)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):  # it has exited already
                conn.send(None)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in self._processes:
            if stop_now:
                process.kill()
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> ClientProcesses:
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        self.close(stop_now=exc_type is not None)


def _process_main(conn: Connection, settings: ClientSettings) -> None:
    """A load generator process: for each level, its jobs, then `None` to stop (also in place
    of a level's start, when another process failed)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent stops us
    while (jobs := conn.recv()) is not None:
        done = asyncio.run(_run_level(conn, settings, jobs))
        if done is None:
            return
        conn.send(done)


async def _run_level(
    conn: Connection, settings: ClientSettings, jobs: list[ClientJob]
) -> JobsDone | None:
    """The level's results; None when it was called off: before its start, or during it (the
    parent sends nothing then unless it stops, and its end of the pipe closes if it dies)."""
    client = settings.client()
    loop = asyncio.get_running_loop()
    try:
        await warm_up(client, len(jobs))
        conn.send("ready")
        start_at = conn.recv()  # nothing else runs in this event loop yet: blocking is fine
        if start_at is None:
            return None
        loop.add_reader(conn.fileno(), asyncio.current_task().cancel)
        try:
            return await run_jobs(client, settings, jobs, start_at)
        except asyncio.CancelledError:
            return None
        finally:
            loop.remove_reader(conn.fileno())
    finally:
        await client.close()
