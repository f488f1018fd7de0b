"""The engine's stepping loop, on a thread of the caller's process or in a process of its own.

A step's host work (scheduling, launching kernels, sampling) needs the GIL, and so does a
server's work for every token of every stream. In one process the two take turns while the GPU
waits, so every decode step takes longer while responses stream (docs/benchmarks.md, "Engine
internals"). In its own process the engine has a GIL of its own, and
what crosses between the processes is small: each step's new token ids and new text per request.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.util import Finalize
from typing import Any

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.device import resolve_device, use_one_host_thread
from sparse_core.engine.llm_engine import EngineStats, LLMEngine
from sparse_core.engine.request_checker import RequestChecker
from sparse_core.outputs import RequestOutput, TokenLogprobs
from sparse_core.sequence import Sequence

logger = logging.getLogger(__name__)

# ("add", Sequence) | ("abort", request_id) | ("stop", None)
Command = tuple[str, Any]
STARTUP_POLL_S = 1.0
SHUTDOWN_TIMEOUT_S = 30.0
# Before the interpreter joins its child processes at exit, so that an engine process still
# running is told to stop instead of waited for.
STOP_EXIT_PRIORITY = 10


@dataclass
class StepResult:
    """What one pass of the loop produced: outputs of the requests that moved (or were aborted),
    the requests that ended in an error with its message, and the engine's counts after it."""

    outputs: list[RequestOutput]
    errors: list[tuple[str, str]]
    stats: EngineStats


def run_loop(
    engine: LLMEngine,
    receive: Callable[[bool], Command | None],
    publish: Callable[[StepResult], None],
) -> None:
    """Until a stop command: take the commands that came in (waiting for one while idle), then
    run a step if there is work, and publish what happened. `receive(block)` returns the next
    command, or None when there is none and `block` is false."""
    while True:
        outputs: list[RequestOutput] = []
        command = receive(not engine.has_unfinished)
        while command is not None:
            kind, arg = command
            if kind == "stop":
                return
            if kind == "add":
                engine.add_sequence(arg)
            elif kind == "abort":
                aborted = engine.abort(arg)
                if aborted is not None:
                    outputs.append(aborted)
            command = receive(False)
        errors: list[tuple[str, str]] = []
        if engine.has_unfinished:
            try:
                outputs += engine.step()
            except Exception as exc:  # fails the request that caused it, not the others
                logger.exception("engine step failed")
                errors = engine.recover_from_failed_step(f"engine step failed: {exc}")
        publish(StepResult(outputs, errors, engine.stats()))


def fail_all(engine: LLMEngine, message: str) -> list[tuple[str, str]]:
    """Abort every request (freeing its blocks) and say why, for each."""
    errors = []
    for request_id in list(engine.sequences):
        engine.abort(request_id)
        errors.append((request_id, message))
    return errors


class ThreadEngineCore:
    """The engine stepping on a thread of this process."""

    def __init__(self, engine: LLMEngine, publish: Callable[[StepResult], None]) -> None:
        self.engine = engine
        self.checker: RequestChecker = engine.checker
        self.initial_stats = engine.stats()
        self._publish = publish
        self._commands: queue.Queue[Command] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvsparse-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            run_loop(self.engine, self._receive, self._publish)
        except Exception as exc:  # no request in flight may wait forever
            logger.exception("engine loop failed")
            errors = fail_all(self.engine, f"the engine stopped: {exc}")
            self._publish(StepResult([], errors, self.engine.stats()))

    def _receive(self, block: bool) -> Command | None:
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self.send(("stop", None))
        self._thread.join(timeout=SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            # Its memory goes with the process: freed under a running step, the step would fail.
            logger.warning("the engine loop did not stop in %d s; left running", SHUTDOWN_TIMEOUT_S)
            return
        self.engine.shutdown()


@dataclass
class OutputDelta:
    """A request's output after a step, as it crosses from the engine process: the new token
    ids (and their logprobs), and the text as the first `keep_chars` characters already sent
    plus `new_text` (a stop string may cut text already sent); finish fields and counts as in
    the output."""

    output: RequestOutput  # prompt and prompt ids left out, token_ids and logprobs the new ones
    keep_chars: int
    new_text: str


@dataclass
class _InFlight:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    text: str = ""


class ProcessEngineCore:
    """The engine in a process of its own; here, a thread sends it commands and another
    receives each step's outputs and makes them whole again.

    Start-up errors of the engine (a bad model, no memory for the KV cache) are raised here, as
    ValueError when the engine raised one. If the engine process dies, every request in flight
    ends with an error. The process is spawned (CUDA cannot be used in a forked child), so a
    script that starts it must guard its own start with `if __name__ == "__main__":`.
    """

    def __init__(
        self,
        config: EngineConfig,
        sparsity: SparsityConfig,
        publish: Callable[[StepResult], None],
    ) -> None:
        self._publish = publish
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        # Not a daemon: its tensor-parallel workers are its own child processes.
        self.process = context.Process(
            target=engine_process_main,
            args=(config, sparsity, child_conn, logging.getLogger().getEffectiveLevel()),
            name="kvsparse-engine",
        )
        self.process.start()
        child_conn.close()
        # Commands go through a queue and a thread: a write to a full pipe (the engine busy in
        # a long step) never blocks the caller's event loop.
        self._outbox: queue.Queue[Command | None] = queue.Queue()
        self._stop = Finalize(
            self,
            _stop_process,
            args=(self.process, self._conn, self._outbox),
            exitpriority=STOP_EXIT_PRIORITY,
        )
        self.checker, self.initial_stats = self._wait_until_ready()
        self._stats = self.initial_stats
        self._requests: dict[str, _InFlight] = {}
        self._sender = threading.Thread(target=self._send_loop, name="kvsparse-engine-in")
        self._reader = threading.Thread(target=self._read_loop, name="kvsparse-engine-out")
        for thread in (self._sender, self._reader):
            thread.daemon = True
            thread.start()

    def _wait_until_ready(self) -> tuple[RequestChecker, EngineStats]:
        try:
            while not self._conn.poll(STARTUP_POLL_S):
                if not self.process.is_alive():
                    break
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._stop()
            raise RuntimeError(
                f"the engine process exited during start-up (exit code {self.process.exitcode}); "
                f"its log above says why. A script that starts an engine on a GPU must do so "
                f'under `if __name__ == "__main__":` (the engine process is spawned)'
            ) from None
        if kind == "ready":
            return payload
        self._stop()
        error_type, message = payload
        if error_type == "ValueError":
            raise ValueError(message)
        raise RuntimeError(f"the engine failed to start: {error_type}: {message}")

    def send(self, command: Command) -> None:
        """Queue a command; never blocks."""
        kind, arg = command
        if kind == "add":
            seq: Sequence = arg
            self._requests[seq.request_id] = _InFlight(seq.prompt, seq.prompt_token_ids)
        self._outbox.put(command)

    def _send_loop(self) -> None:
        while (command := self._outbox.get()) is not None:
            kind, arg = command
            if kind == "add":
                arg = (
                    arg.request_id,
                    arg.prompt_token_ids,
                    arg.params,
                    arg.prompt,
                    arg.arrival_time,
                )
            try:
                self._conn.send((kind, arg))
            except OSError:
                if kind == "add":  # an abort or stop for a stopped engine has nothing to do
                    self._requests.pop(arg[0], None)
                    self._publish(
                        StepResult([], [(arg[0], "the engine process has stopped")], self._stats)
                    )

    def _read_loop(self) -> None:
        try:
            while True:
                try:
                    deltas, errors, self._stats = self._conn.recv()
                except (EOFError, OSError):
                    return
                outputs = [out for delta in deltas if (out := self._whole(delta)) is not None]
                for request_id, _ in errors:
                    self._requests.pop(request_id, None)
                self._publish(StepResult(outputs, errors, self._stats))
        finally:
            # The engine process is gone (stopped, or died): no request in flight may wait.
            self.process.join(timeout=SHUTDOWN_TIMEOUT_S)
            message = f"the engine process stopped (exit code {self.process.exitcode})"
            errors = [(request_id, message) for request_id in list(self._requests)]
            self._requests.clear()
            if errors:
                self._publish(StepResult([], errors, self._stats))

    def _whole(self, delta: OutputDelta) -> RequestOutput | None:
        out = delta.output
        request = self._requests.get(out.request_id)
        if request is None:  # the callers keep ids unique while in flight: not expected
            logger.warning("output for unknown request %s dropped", out.request_id)
            return None
        request.token_ids += out.token_ids
        request.text = request.text[: delta.keep_chars] + delta.new_text
        if out.logprobs is not None:
            request.logprobs += out.logprobs
        if out.finished:
            del self._requests[out.request_id]
        return dataclasses.replace(
            out,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.token_ids),
            text=request.text,
            logprobs=None if out.logprobs is None else list(request.logprobs),
        )

    def is_alive(self) -> bool:
        return self.process.is_alive() and self._reader.is_alive()

    def shutdown(self) -> None:
        self._stop()
        self._reader.join(timeout=SHUTDOWN_TIMEOUT_S)


def _stop_process(
    process: mp.process.BaseProcess, conn: Connection, outbox: queue.Queue[Command | None]
) -> None:
    """Ask the engine process to stop (after the commands already queued), wait, then make
    sure: kill it if it does not stop in time."""
    outbox.put(("stop", None))
    outbox.put(None)  # the sender thread ends
    process.join(timeout=SHUTDOWN_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


def engine_process_main(
    config: EngineConfig, sparsity: SparsityConfig, conn: Connection, log_level: int
) -> None:
    """The engine process: start the engine, say it is ready (or why not), then run the loop
    until told to stop or until the parent goes away (its end of the pipe closes)."""
    # Ctrl-C in a terminal reaches every process of the group: the parent decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if resolve_device(config.device).type == "cuda":
        use_one_host_thread()
    try:
        engine = LLMEngine(config, sparsity)
    except Exception as exc:
        logger.exception("engine start-up failed")
        conn.send(("failed", (type(exc).__name__, str(exc))))
        return
    conn.send(("ready", (engine.checker, engine.stats())))
    sent: dict[str, tuple[int, int]] = {}  # per request: output ids and text chars sent

    def receive(block: bool) -> Command | None:
        if not conn.poll(None if block else 0):
            return None
        try:
            kind, arg = conn.recv()
        except EOFError:
            return "stop", None
        if kind == "add":
            request_id, token_ids, params, prompt, arrival = arg
            arg = Sequence(request_id, token_ids, params, len(engine.plan.groups), prompt, arrival)
        return kind, arg

    def delta(out: RequestOutput) -> OutputDelta:
        num_ids, num_chars = sent.pop(out.request_id, (0, 0))
        keep = min(num_chars, len(out.text))  # text only grows, or a stop string cuts its end
        if not out.finished:
            sent[out.request_id] = (len(out.token_ids), len(out.text))
        output = dataclasses.replace(
            out,
            prompt=None,
            prompt_token_ids=[],
            token_ids=out.token_ids[num_ids:],
            text="",
            logprobs=None if out.logprobs is None else out.logprobs[num_ids:],
        )
        return OutputDelta(output, keep, out.text[keep:])

    def publish(result: StepResult) -> None:
        for request_id, _ in result.errors:
            sent.pop(request_id, None)
        conn.send(([delta(out) for out in result.outputs], result.errors, result.stats))

    try:
        run_loop(engine, receive, publish)
    except (OSError, EOFError):
        pass  # the parent went away
    finally:
        engine.shutdown()
