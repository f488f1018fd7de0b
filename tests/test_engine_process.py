"""The engine in a process of its own (the default on GPUs): the same outputs as on a thread,
start-up errors raised to the caller, and no process left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparse_core import AsyncLLM, EngineConfig, SamplingParams, SparsityConfig

CONFIG = EngineConfig(model="dummy:smollm2-135m", max_model_len=512, kv_cache_memory_gb=0.05)
SPARSITY = SparsityConfig(policy="snapkv", budget=40, window=8, full_layers=2)


async def final_outputs(llm: AsyncLLM, prompts: list[list[int]], params: SamplingParams):
    async def last(prompt):
        return [out async for out in llm.generate(prompt, params)][-1]

    return await asyncio.gather(*(last(p) for p in prompts))


def test_outputs_match_the_engine_on_a_thread():
    prompts = [[(i * 37 + j) % 250 + 1 for j in range(60 + 13 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    results = {}
    for engine_process in (False, True):
        llm = AsyncLLM(CONFIG, SPARSITY, engine_process=engine_process)
        try:
            results[engine_process] = asyncio.run(final_outputs(llm, prompts, params))
        finally:
            llm.shutdown()
    for on_thread, in_process, prompt in zip(results[False], results[True], prompts, strict=True):
        assert in_process.prompt_token_ids == prompt
        assert in_process.token_ids == on_thread.token_ids and len(in_process.token_ids) == 16
        assert in_process.text == on_thread.text
        assert in_process.finish_reason == "length"
        assert in_process.compression_ratio == on_thread.compression_ratio > 1.0
        assert in_process.kv_tokens_per_group == on_thread.kv_tokens_per_group
        # Logprobs cross as the new tokens' only, and come out whole.
        assert [e.token_id for e in in_process.logprobs] == in_process.token_ids
        assert [[t for t, _ in e.top] for e in in_process.logprobs] == [
            [t for t, _ in e.top] for e in on_thread.logprobs
        ]
        assert [e.logprob for e in in_process.logprobs] == pytest.approx(
            [e.logprob for e in on_thread.logprobs], abs=1e-5
        )


def test_text_cut_by_a_stop_string_matches_the_engine_on_a_thread():
    """Text crosses as characters appended to what was sent; a stop string cuts text that was
    already sent, and the whole text must still come out the same."""
    prompt = [(j * 7) % 250 + 1 for j in range(70)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    on_thread = AsyncLLM(CONFIG, SPARSITY, engine_process=False)
    in_process = AsyncLLM(CONFIG, SPARSITY, engine_process=True)
    try:
        full = asyncio.run(final_outputs(on_thread, [prompt], greedy))[0].text
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        expected = asyncio.run(final_outputs(on_thread, [prompt], params))[0]
        got = asyncio.run(final_outputs(in_process, [prompt], params))[0]
    finally:
        on_thread.shutdown()
        in_process.shutdown()
    assert expected.finish_reason == "stop" and len(expected.text) < len(full)
    assert (got.text, got.token_ids, got.finish_reason) == (
        expected.text,
        expected.token_ids,
        expected.finish_reason,
    )


def test_a_start_up_error_is_raised_to_the_caller():
    with pytest.raises(ValueError, match="unknown dummy preset 'nope'"):
        AsyncLLM(EngineConfig(model="dummy:nope"), SPARSITY, engine_process=True)


def pid_alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by whoever adopted it, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for_exit(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_shutdown_stops_the_engine_process():
    llm = AsyncLLM(CONFIG, SPARSITY, engine_process=True)
    pid = llm._core.process.pid
    assert llm.is_running
    llm.shutdown()
    assert wait_for_exit(pid)
    assert not llm.is_running


def test_the_engine_process_exits_when_its_parent_dies():
    """A server killed without a chance to shut down leaves no engine holding the GPU."""
    script = textwrap.dedent(
        """
        import os, sys
        from sparse_core import AsyncLLM, EngineConfig, SparsityConfig
        llm = AsyncLLM(EngineConfig(model="dummy:tiny", max_model_len=256,
                                                kv_cache_memory_gb=0.01),
                                   SparsityConfig(), engine_process=True)
        print(llm._core.process.pid, flush=True)
        os._exit(0)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert wait_for_exit(int(done.stdout.split()[-1]))


def test_a_request_in_flight_fails_when_the_engine_process_dies():
    llm = AsyncLLM(CONFIG, SPARSITY, engine_process=True)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def kill_after_first_output():
        async for _ in llm.generate(list(range(1, 80)), params):
            os.kill(llm._core.process.pid, signal.SIGKILL)

    try:
        with pytest.raises(RuntimeError, match="engine process stopped"):
            asyncio.run(asyncio.wait_for(kill_after_first_output(), timeout=60))
        assert not llm.is_running
        with pytest.raises(RuntimeError, match="engine process has stopped"):
            asyncio.run(kill_after_first_output())
    finally:
        llm.shutdown()
