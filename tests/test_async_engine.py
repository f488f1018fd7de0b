"""The async interface the HTTP service wraps: streaming, concurrency, abort freeing blocks."""

from __future__ import annotations

import asyncio
import gc
from itertools import pairwise

import pytest

from sparse_core import AsyncLLM, EngineConfig, SamplingParams, SparsityConfig


@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
def engine(request):
    """The engine on a thread of this process, and in a process of its own (the GPU default).
    On the CPU wherever the tests run: a request's greedy tokens in a batch equal its tokens
    alone only where the math does not depend on the batch (float32 on CPU; not bf16 on a GPU,
    where `tests/test_engine_process.py` runs the engine process)."""
    config = EngineConfig(
        model="dummy:tiny", max_model_len=512, kv_cache_memory_gb=0.01, device="cpu"
    )
    sparsity = SparsityConfig(policy="snapkv", budget=40, window=8, full_layers=1)
    llm = AsyncLLM(config, sparsity, engine_process=request.param)
    yield llm
    llm.shutdown()


def used_blocks(engine: AsyncLLM) -> int:
    return sum(group["used"] for group in engine.stats().kv_blocks.values())


async def collect(engine, prompt, params):
    outs = [out async for out in engine.generate(prompt, params)]
    return outs


async def until(condition, timeout_s: float = 4.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return False


def test_stream_yields_growing_outputs_and_finishes(engine):
    """One output per step, cumulative; a consumer that falls behind the engine gets the newest
    only, so steps may be skipped but never repeated or reordered."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = asyncio.run(collect(engine, list(range(1, 100)), params))
    lengths = [len(o.token_ids) for o in outs]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 12
    assert all(o.token_ids[: len(a.token_ids)] == a.token_ids for a, o in pairwise(outs))
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])


def test_concurrent_requests_match_sequential_ones(engine):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 31 + j) % 400 + 1 for j in range(20 + 9 * i)] for i in range(8)]

    async def run_all():
        return await asyncio.gather(*(collect(engine, p, params) for p in prompts))

    together = asyncio.run(run_all())
    for prompt, outs in zip(prompts, together, strict=True):
        alone = asyncio.run(collect(engine, prompt, params))
        assert outs[-1].token_ids == alone[-1].token_ids


def test_consumer_that_stops_early_aborts_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def disconnect_after(n):
        seen = 0
        async for _ in engine.generate(list(range(1, 90)), params):
            seen += 1
            if seen == n:
                assert used_blocks(engine) > 0
                break  # like a client that went away mid-stream

    asyncio.run(disconnect_after(3))
    idle = until(lambda: used_blocks(engine) == 0 and engine.stats().num_running == 0)
    assert asyncio.run(idle)


def test_a_request_is_queued_before_its_stream_is_read_and_closing_it_aborts(engine):
    """A server queues each request as it validates it (a burst's first prompt does not wait
    for the others to be parsed); a stream closed before it was read still aborts its request:
    a request sent after it then runs alone."""
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def scenario():
        unread = engine.generate(list(range(1, 90)), params)
        queued = await until(lambda: used_blocks(engine) > 0)
        await unread.aclose()
        running = []
        async for out in engine.generate(list(range(1, 40)), params):
            if len(out.token_ids) >= 50:  # steps after the abort reached the engine
                running.append(engine.stats().num_running)
                break
        return queued, running

    assert asyncio.run(scenario()) == (True, [1])


def test_a_stream_dropped_unread_aborts_its_request(engine):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def scenario():
        unread = engine.generate(list(range(1, 90)), params)
        await until(lambda: used_blocks(engine) > 0)
        del unread  # never read, never closed
        gc.collect()
        async for out in engine.generate(list(range(1, 40)), params):
            if len(out.token_ids) >= 50:
                return engine.stats().num_running

    assert asyncio.run(scenario()) == 1


def test_closing_a_finished_stream_late_leaves_a_new_request_of_its_id_alone(engine):
    """A request that finished frees its id at once, even before its consumer reads the last
    output; the old stream closed after that must not abort the new request of that id."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, 50))

    async def scenario():
        old = engine.generate(prompt, params, request_id="late")
        for _ in range(500):  # until the old request has finished (its id is free)
            try:
                new = engine.generate(prompt, params, request_id="late")
                break
            except ValueError:
                await asyncio.sleep(0.01)
        await old.aclose()  # its last output never read
        return [out async for out in new]

    outs = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 4


def test_invalid_request_raises_before_streaming(engine):
    async def bad():
        async for _ in engine.generate([], SamplingParams()):
            pass

    with pytest.raises(ValueError, match="prompt is empty"):
        asyncio.run(bad())


def test_a_request_id_is_reused_only_after_its_request_ended(engine):
    """A consumer that went away leaves its request's abort on the way back; a new request
    with the same id meanwhile is refused, and one after it gets its own outputs only."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, 50))

    async def scenario():
        first = engine.generate(prompt, params, request_id="same")
        await anext(first)
        await first.aclose()  # aborts; the engine's abort output comes back later
        again = None
        for _ in range(200):
            try:
                again = engine.generate(prompt, params, request_id="same")
                break
            except ValueError as exc:
                assert "already in use" in str(exc)
                await asyncio.sleep(0.01)
        return [out async for out in again]

    outs = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    alone = asyncio.run(collect(engine, prompt, params))
    assert all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].finish_reason == "length"
    assert outs[-1].token_ids == alone[-1].token_ids and len(alone[-1].token_ids) == 6
