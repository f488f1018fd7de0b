"""Randomised workloads: arrivals, aborts, preemptions, stops and prefix cache hits and
evictions never leak a block or hold one more or less often than its sequences do, with whole
prompts, prompts split by compress_prefix_len and prompts prefilled in chunks; and a preempted
split request recomputes to the same output."""

from __future__ import annotations

import random
import zlib

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig

SPARSITIES = {
    "dense": SparsityConfig(policy="dense"),
    "snapkv": SparsityConfig(policy="snapkv", budget=40, window=8, sinks=2, full_layers=1),
    "pyramid": SparsityConfig(policy="pyramid", budget=40, window=8, sinks=2, full_layers=[2]),
    "streamingllm": SparsityConfig(policy="streamingllm", budget=40, window=8, full_layers=1),
    "random": SparsityConfig(policy="random", budget=40, window=8, full_layers=0),
}


# Every policy with the prefix cache (the default); without it, a whole group and a sparse one.
WORKLOADS = [(name, chunked, True) for name in SPARSITIES for chunked in (False, True)] + [
    (name, chunked, False) for name in ("dense", "snapkv") for chunked in (False, True)
]


@pytest.mark.parametrize(
    ("name", "chunked", "caching"),
    WORKLOADS,
    ids=[
        f"{n}-{'chunked' if c else 'whole'}-{'cache' if p else 'no-cache'}" for n, c, p in WORKLOADS
    ],
)
def test_random_workload_keeps_every_pool_consistent(name, chunked, caching):
    rng = random.Random(zlib.crc32(name.encode()))  # hash() of a str differs per process
    # Half the prompts start with one of three documents: prefix cache hits, and evictions
    # (the cache holds what the running sequences leave free).
    documents = [[rng.randrange(1, 500) for _ in range(n)] for n in (32, 64, 96)]
    llm = LLM(
        "dummy:tiny",
        sparsity=SPARSITIES[name],
        max_model_len=512,
        max_num_seqs=12,
        # Chunked: prompts (up to 200 tokens) share steps of 64 prompt tokens.
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=64 if chunked else None,
        # Small enough that decode growth forces preemptions.
        kv_cache_memory_gb=0.0006,
        expected_input_len=150,
        enable_prefix_caching=caching,
    )
    engine = llm.engine
    submitted, finished, aborted, split = 0, {}, set(), set()
    for _ in range(400):
        if submitted < 60 and rng.random() < 0.7:
            prompt = rng.choice(documents) if rng.random() < 0.5 else []
            prompt = prompt + [rng.randrange(1, 500) for _ in range(rng.randrange(5, 120))]
            # A third of the requests compress only a prefix and are fed the rest token by token.
            prefix = rng.randrange(1, len(prompt) + 1) if rng.random() < 0.33 else None
            params = SamplingParams(
                compress_prefix_len=prefix,
                max_tokens=rng.randrange(1, 60),
                temperature=rng.choice([0.0, 0.8]),
                seed=rng.randrange(100),
                stop_token_ids=[rng.randrange(1, 500)] if rng.random() < 0.3 else [],
                ignore_eos=True,
            )
            engine.add_request(f"r{submitted}", prompt, params)
            if prefix is not None:
                split.add(f"r{submitted}")
            submitted += 1
        if engine.sequences and rng.random() < 0.1:
            victim = rng.choice(list(engine.sequences))
            assert engine.abort(victim).finish_reason == "abort"
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
        if submitted >= 60 and not engine.has_unfinished:
            break
    while engine.has_unfinished:
        for out in engine.step():
            finished[out.request_id] = out
        engine.check_invariants()

    assert engine.scheduler.num_preemptions > 0, "the workload should have forced preemptions"
    assert len(finished) + len(aborted) == submitted
    for out in finished.values():
        assert out.finish_reason in ("stop", "length")
        assert len(out.token_ids) >= 1
        assert out.first_token_time is not None
    pool = engine.block_manager.pool
    assert pool.num_free == pool.num_blocks
    hits = engine.block_manager.prefix_cache_hits
    if not caching:
        assert hits == 0
    elif name != "pyramid":  # its smallest pool (17 blocks) is too full here to cache a prompt
        assert hits > 0


def test_a_preempted_split_request_gives_the_output_it_gives_alone():
    """Dense, greedy: recomputing after preemption (the prefix prefilled again, the rest of the
    prompt and the outputs so far fed again) must not change what the request generates."""

    def tiny_llm() -> LLM:
        # 19 blocks of 16 tokens: the two requests below need 24 together.
        return LLM("dummy:tiny", max_model_len=512, kv_cache_memory_gb=0.0003, block_size=16)

    rng = random.Random(0)
    long_prompt = [rng.randrange(1, 500) for _ in range(100)]
    split_prompt = [rng.randrange(1, 500) for _ in range(150)]
    long_params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    split_params = SamplingParams(
        compress_prefix_len=20, max_tokens=20, temperature=0.0, ignore_eos=True
    )
    alone = tiny_llm().generate([split_prompt], split_params)[0]
    assert alone.num_preemptions == 0
    # Submitted second, the split request is the newest, so it is the one preempted.
    together = tiny_llm().generate([long_prompt, split_prompt], [long_params, split_params])
    assert together[0].num_preemptions == 0
    assert together[1].num_preemptions >= 1
    assert together[1].token_ids == alone.token_ids
