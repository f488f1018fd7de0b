"""The engine's stepping loop, on a thread of the caller's process or in a process of its own.

A step's host work (scheduling, launching kernels, sampling) needs the GIL, and so does a
server's work for every token of every stream. In one process the two take turns while the GPU
waits: on an H200, a snapkv decode step at batch 20 took 11.2 ms while the server streamed 20
responses, against about 7 ms offline. In its own process the engine has a GIL of its own, and
what crosses between the processes is small: each step's new tokens and text per request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import queue
import signal
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.llm_engine import EngineStats, LLMEngine
from sparse_core.engine.model_runner import resolve_device, use_one_host_thread
from sparse_core.engine.outputs import RequestOutput
from sparse_core.engine.request_checker import RequestChecker
from sparse_core.engine.sequence import Sequence

logger = logging.getLogger(__name__)

# ("add", Sequence) | ("abort", request_id) | ("stop", None)
Command = tuple[str, Any]
STARTUP_POLL_S = 1.0
SHUTDOWN_TIMEOUT_S = 30.0


@dataclass
class StepResult:
    """What one pass of the loop produced: outputs of the requests that moved (or were aborted),
    the requests a failed step ended with its error message, and the engine's counts after it."""

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
            except Exception as exc:  # a failed step fails its requests, not the server
                logger.exception("engine step failed")
                for request_id in list(engine.sequences):
                    engine.abort(request_id)
                    errors.append((request_id, f"engine step failed: {exc}"))
        publish(StepResult(outputs, errors, engine.stats()))


class ThreadEngineCore:
    """The engine stepping on a thread of this process."""

    def __init__(self, engine: LLMEngine, publish: Callable[[StepResult], None]) -> None:
        self.engine = engine
        self.checker: RequestChecker = engine.checker
        self.initial_stats = engine.stats()
        self._commands: queue.Queue[Command] = queue.Queue()
        self._thread = threading.Thread(
            target=run_loop, args=(engine, self._receive, publish), name="kvsparse-engine"
        )
        self._thread.daemon = True
        self._thread.start()

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
        self.engine.shutdown()


class ProcessEngineCore:
    """The engine in a process of its own; a thread here receives each step's outputs.

    Outputs cross as deltas (the step's new token ids, and the text, which a stop string may cut
    back) and are made whole again here, so the prompt's ids never cross twice. Start-up errors
    of the engine (a bad model, no memory for the KV cache) are raised here, as ValueError when
    the engine raised one.
    """

    def __init__(
        self,
        config: EngineConfig,
        sparsity: SparsityConfig,
        publish: Callable[[StepResult], None],
    ) -> None:
        self._publish = publish
        context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child_conn = context.Pipe()
        # Not a daemon: its tensor-parallel workers are its own child processes.
        self.process = context.Process(
            target=engine_process_main, args=(config, sparsity, child_conn), name="kvsparse-engine"
        )
        self.process.start()
        child_conn.close()
        self._stop = weakref.finalize(self, _stop_process, self.process, self._conn)
        self.checker, self.initial_stats = self._wait_until_ready()
        self._send_lock = threading.Lock()
        # Per request in flight: its prompt text, prompt ids and output ids so far.
        self._requests: dict[str, tuple[str | None, list[int], list[int]]] = {}
        self._reader = threading.Thread(target=self._read, name="kvsparse-engine-outputs")
        self._reader.daemon = True
        self._reader.start()

    def _wait_until_ready(self) -> tuple[RequestChecker, EngineStats]:
        while not self._conn.poll(STARTUP_POLL_S):
            if not self.process.is_alive():
                self._stop()
                raise RuntimeError(
                    f"the engine process exited during start-up (exit code "
                    f"{self.process.exitcode}); its log above says why"
                )
        kind, payload = self._conn.recv()
        if kind == "ready":
            return payload
        self._stop()
        error_type, message = payload
        raise (ValueError if error_type == "ValueError" else RuntimeError)(message)

    def send(self, command: Command) -> None:
        kind, arg = command
        if kind == "add":
            seq: Sequence = arg
            self._requests[seq.request_id] = (seq.prompt, seq.prompt_token_ids, [])
            arg = (seq.request_id, seq.prompt_token_ids, seq.params, seq.prompt)
        with self._send_lock:
            try:
                self._conn.send((kind, arg))
            except (BrokenPipeError, OSError):
                if kind == "add":  # an abort or stop of a stopped engine has nothing to do
                    self._requests.pop(arg[0], None)
                    raise RuntimeError("the engine process has stopped") from None

    def _read(self) -> None:
        stats = self.initial_stats
        while True:
            try:
                deltas, errors, stats = self._conn.recv()
            except (EOFError, OSError):
                break
            outputs = [self._whole(delta) for delta in deltas]
            for request_id, _ in errors:
                self._requests.pop(request_id, None)
            self._publish(StepResult(outputs, errors, stats))
        # The engine process is gone (stopped, or died): no request in flight may wait forever.
        self.process.join(timeout=SHUTDOWN_TIMEOUT_S)
        message = f"the engine process stopped (exit code {self.process.exitcode})"
        errors = [(request_id, message) for request_id in list(self._requests)]
        self._requests.clear()
        if errors:
            self._publish(StepResult([], errors, stats))

    def _whole(self, delta: RequestOutput) -> RequestOutput:
        prompt, prompt_ids, token_ids = self._requests[delta.request_id]
        token_ids += delta.token_ids
        if delta.finished:
            del self._requests[delta.request_id]
        return dataclasses.replace(
            delta, prompt=prompt, prompt_token_ids=prompt_ids, token_ids=list(token_ids)
        )

    def is_alive(self) -> bool:
        return self.process.is_alive() and self._reader.is_alive()

    def shutdown(self) -> None:
        self._stop()
        self._reader.join(timeout=SHUTDOWN_TIMEOUT_S)


def _stop_process(process: mp.process.BaseProcess, conn: Connection) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):
        conn.send(("stop", None))
    process.join(timeout=SHUTDOWN_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


def engine_process_main(config: EngineConfig, sparsity: SparsityConfig, conn: Connection) -> None:
    """The engine process: start the engine, say it is ready (or why not), then run the loop
    until told to stop or until the parent goes away (its end of the pipe closes)."""
    # Ctrl-C in a terminal reaches every process of the group: the parent decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if resolve_device(config.device).type == "cuda":
        use_one_host_thread()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine = LLMEngine(config, sparsity)
    except Exception as exc:
        logger.exception("engine start-up failed")
        conn.send(("failed", (type(exc).__name__, str(exc))))
        return
    conn.send(("ready", (engine.checker, engine.stats())))
    num_sent: dict[str, int] = {}  # output ids already sent, per request

    def receive(block: bool) -> Command | None:
        if not conn.poll(None if block else 0):
            return None
        try:
            kind, arg = conn.recv()
        except EOFError:
            return "stop", None
        if kind == "add":
            request_id, token_ids, params, prompt = arg
            arg = Sequence(request_id, token_ids, params, len(engine.plan.groups), prompt=prompt)
        return kind, arg

    def delta(out: RequestOutput) -> RequestOutput:
        start = num_sent.pop(out.request_id, 0)
        if not out.finished:
            num_sent[out.request_id] = len(out.token_ids)
        return dataclasses.replace(
            out, prompt=None, prompt_token_ids=[], token_ids=out.token_ids[start:]
        )

    def publish(result: StepResult) -> None:
        for request_id, _ in result.errors:
            num_sent.pop(request_id, None)
        conn.send(([delta(out) for out in result.outputs], result.errors, result.stats))

    try:
        run_loop(engine, receive, publish)
    except (BrokenPipeError, EOFError):
        pass  # the parent went away
    finally:
        engine.shutdown()
