"""Chunked prefill: a prompt prefilled over several steps generates what it generates whole, keeps
the same tokens in every layer group, and holds (then frees) blocks for all its tokens until its
last chunk."""

from __future__ import annotations

import random

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.config import EngineConfig
from sparse_core.models.loader import load_model_source

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# The first 3 layers whole (full_layers unset would take SmolLM2's calibrated 10, whose larger
# whole group leaves the sparse pools too small for a 500-token chunked prompt in 0.05 GB).
SPARSITIES = {
    "dense": SparsityConfig(policy="dense"),
    "snapkv": SparsityConfig(policy="snapkv", budget=64, window=8, full_layers=3),
    "pyramid": SparsityConfig(policy="pyramid", budget=64, window=8, full_layers=3),
    "streamingllm": SparsityConfig(policy="streamingllm", budget=64, window=8, full_layers=3),
}


@pytest.fixture(scope="module")
def smollm2_source():
    return load_model_source("smollm2-135m-instruct", {})


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in (300, 77, 150, 500)]


@pytest.mark.parametrize("name", list(SPARSITIES))
def test_chunked_prompts_generate_what_whole_prompts_do(smollm2_source, name):
    """SmolLM2, greedy: the same tokens and the same kept tokens per layer group, with prompts cut
    into chunks of at most 100 tokens that share steps with other prompts and with decodes."""

    def generate(**engine_args):
        llm = LLM(
            sparsity=SPARSITIES[name],
            model_source=smollm2_source,
            device="cpu",  # float32: exact agreement (tests/test_gpu_engine.py has the GPU's)
            max_model_len=1024,
            kv_cache_memory_gb=0.05,
            **engine_args,
        )
        llm.engine.step_records = []
        return llm.generate(_prompts(), GREEDY), llm.engine

    whole, _ = generate()
    chunked, engine = generate(enable_chunked_prefill=True, max_num_batched_tokens=100)
    for a, b in zip(whole, chunked, strict=True):
        assert b.token_ids == a.token_ids
        assert b.kv_tokens_per_group == a.kv_tokens_per_group
        assert b.compression_ratio == a.compression_ratio
    prefill_steps = [r.num_prefill_tokens for r in engine.step_records if r.is_prefill]
    assert max(prefill_steps) <= 100
    assert sum(prefill_steps) == sum(len(p) for p in _prompts())
    assert len(prefill_steps) >= 1030 // 100  # 1027 prompt tokens, 100 per step at most
    # Decodes rode along with later chunks.
    assert any(r.is_prefill and r.num_decode_seqs for r in engine.step_records)
    engine.check_invariants()
    pool = engine.block_manager.pool
    assert pool.num_free == pool.num_blocks


def _tiny(**engine_args) -> LLM:
    return LLM(
        "dummy:tiny",
        # Two whole layers and two sparse ones: two KV groups of two layers.
        sparsity=SparsityConfig(policy="snapkv", budget=40, window=8, sinks=2, full_layers=2),
        device="cpu",
        max_model_len=512,
        enable_chunked_prefill=True,
        **engine_args,
    )


def test_the_last_chunk_holds_the_observation_window():
    """105 tokens in steps of 100: cut 97 + 8, not 100 + 5, so the window's 8 queries (which
    score every token) are in the last chunk."""
    llm = _tiny(max_num_batched_tokens=100)
    llm.engine.step_records = []
    llm.generate([list(range(1, 106))], SamplingParams(max_tokens=2, ignore_eos=True))
    prefills = [r.num_prefill_tokens for r in llm.engine.step_records if r.is_prefill]
    assert prefills == [97, 8]


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_a_chunked_prompt_holds_all_its_blocks_until_its_last_chunk(caching):
    """With the prefix cache the sparse group also holds, from the start, the blocks its kept
    tokens go to (3 for a budget of 40)."""
    llm = _tiny(max_num_batched_tokens=100, kv_cache_memory_gb=0.001,
                enable_prefix_caching=caching)  # fmt: skip
    engine = llm.engine
    engine.add_request("r", list(range(1, 301)), SamplingParams(max_tokens=5, ignore_eos=True))
    full, sparse = engine.plan.groups
    for _ in range(2):  # 300 tokens: chunks of 100, 100 and 100
        assert engine.step() == []  # no token before the last chunk
        used = engine.stats().kv_blocks
        assert used[full.name]["used"] == 19  # 300 tokens / 16
        assert used[sparse.name]["used"] == 19 + 3 * caching
    outputs = engine.step()
    assert len(outputs) == 1 and len(outputs[0].token_ids) == 1
    used = engine.stats().kv_blocks
    assert used[full.name]["used"] == 19
    assert used[sparse.name]["used"] == 3  # the budget's 40 tokens
    assert outputs[0].kv_tokens_per_group == {full.name: 300, sparse.name: 40}
    engine.check_invariants()


def test_aborting_a_prompt_between_chunks_frees_its_blocks():
    llm = _tiny(max_num_batched_tokens=64, kv_cache_memory_gb=0.001)
    engine = llm.engine
    engine.add_request("r", list(range(1, 301)), SamplingParams(max_tokens=5))
    engine.step()
    assert engine.stats().kv_blocks["full"]["used"] == 19
    assert engine.abort("r").finish_reason == "abort"
    assert not engine.has_unfinished
    engine.check_invariants()
    pool = engine.block_manager.pool
    assert pool.num_free == pool.num_blocks


def test_a_prompt_longer_than_a_step_needs_room_for_all_its_tokens_in_every_group():
    """Sparse groups hold a chunked prompt whole until its last chunk: a prompt that fits the
    cache only compressed cannot be chunked, and says so."""
    llm = _tiny(max_num_batched_tokens=64, kv_cache_memory_gb=0.0002)
    pool = llm.engine.block_manager.pool.num_blocks
    assert pool == 26  # 0.0002 GiB in blocks of 16 tokens in 2 float32 layers
    # Chunked, both groups hold every token: 209 tokens take 14 blocks in each.
    too_long = llm.engine.config.block_size * (pool // 2) + 1
    with pytest.raises(ValueError, match="needs 28 KV blocks, and the cache has 26"):
        llm.generate([list(range(1, too_long + 1))], SamplingParams(max_tokens=1))
    # A prompt that fits a step and, compressed, the cache, if a preemption would make it
    # prefill more than the cache holds again: its prompt and outputs so far, in chunks.
    prompt = list(range(1, 51))  # kept 40 + outputs fit; staged with them, not
    with pytest.raises(ValueError, match="needs 28 KV blocks"):
        llm.generate([prompt], SamplingParams(max_tokens=too_long - 50 + 5))
    # Its last token is never fed: 207 tokens at most, 13 blocks in each group.
    assert llm.generate([prompt], SamplingParams(max_tokens=too_long - 51))


def test_without_chunked_prefill_a_prompt_longer_than_a_step_runs_whole_and_alone():
    """Steps of 100 prompt tokens: 60 + 30 share one, 150 runs in one of its own (the step
    after has room for the 40 again), generating what steps as long as the model generate."""
    prompts = [list(range(1, 61)), list(range(1, 31)), list(range(5, 155)), list(range(200, 240))]

    def generate(max_num_batched_tokens: int | None) -> tuple[list[list[int]], list[int]]:
        llm = LLM("dummy:tiny", device="cpu", max_model_len=256, kv_cache_memory_gb=0.01,
                  max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
        llm.engine.step_records = []
        outs = llm.generate(prompts, GREEDY)
        llm.engine.check_invariants()
        records = llm.engine.step_records
        return [o.token_ids for o in outs], [r.num_prefill_tokens for r in records if r.is_prefill]

    tokens, prefills = generate(100)
    assert prefills == [90, 150, 40]
    assert EngineConfig(max_num_batched_tokens=100).longest_whole_prefill == 8192
    whole_tokens, whole_prefills = generate(None)
    assert whole_prefills == [280] and tokens == whole_tokens


def test_step_size_limits():
    assert (
        EngineConfig(
            max_model_len=4096, max_num_batched_tokens=2048, enable_chunked_prefill=True
        ).longest_whole_prefill
        == 2048
    )
    with pytest.raises(ValueError, match="observation window"):
        _tiny(max_num_batched_tokens=4)
