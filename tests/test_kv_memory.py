"""The KV cache's blocks: what compression buys in admitted sequences, and which layers keep
what."""

from __future__ import annotations

import random

import torch

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.cache.block_manager import cdiv
from sparse_core.models.rotary import rope_inv_freq

# A 32-layer model with the KV-head layout of Llama-3 scaled down (block accounting depends only
# on the layer count and the per-token KV size, not on the hidden size).
LLAMA3_DEPTH = {"num_hidden_layers": 32}
PROMPT_LEN = 4000


def peak_concurrency(sparsity: SparsityConfig, num_prompts: int) -> tuple[int, dict[str, int]]:
    """The most sequences running at once, and then the token-layers each layer group held
    (blocks used times tokens and layers a block holds)."""
    llm = LLM(
        "dummy:tiny",
        sparsity=sparsity,
        hf_overrides=LLAMA3_DEPTH,
        max_model_len=4096,
        max_num_seqs=256,
        kv_cache_memory_gb=0.15,
        block_size=16,  # the default on CPU, as the block counts below assume
        expected_input_len=PROMPT_LEN,
    )
    engine = llm.engine
    rng = random.Random(0)
    for i in range(num_prompts):
        prompt = [rng.randrange(1, 500) for _ in range(PROMPT_LEN)]
        # Long enough that no sequence finishes while the others are still being admitted
        # (every step decodes the running sequences while it prefills the next prompts).
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    peak, peak_blocks = 0, {}
    while engine.has_unfinished:
        engine.step()
        stats = engine.stats()
        if stats.num_running > peak:
            peak, peak_blocks = stats.num_running, stats.kv_blocks
        engine.check_invariants()
    per_block = engine.retention.layers_per_block * engine.retention.block_size
    return peak, {name: blocks["used"] * per_block for name, blocks in peak_blocks.items()}


def test_snapkv_admits_four_times_as_many_4000_token_sequences_as_dense():
    dense, dense_held = peak_concurrency(SparsityConfig(policy="dense"), 8)
    sparse, sparse_held = peak_concurrency(
        SparsityConfig(policy="snapkv", budget=512, window=32, full_layers=3), 8 * 5
    )
    assert dense >= 2
    assert sparse >= 4 * dense, (dense, sparse)
    # The block usage that explains it: dense holds every prompt token in all 32 layers; the
    # sparse engine holds them in its 3 full layers and 512 of them in the other 29 (in blocks
    # of 3 layers: 30 layer slots).
    assert dense_held["full"] <= dense * 32 * 16 * cdiv(PROMPT_LEN + 4, 16)
    assert sparse_held["budget512"] <= sparse * 30 * 16 * cdiv(512 + 4, 16)
    assert sparse_held["full"] >= sparse * 3 * PROMPT_LEN


def test_a_sparse_layer_holds_its_budget_and_every_token_generated_after_it():
    """Without decode-time eviction a sparse group grows by one token per generated token: at
    the end of a 300-token generation it holds budget + 299 (the last token is never fed)."""
    sparsity = SparsityConfig(policy="snapkv", budget=40, window=8, sinks=2, full_layers=1)
    llm = LLM("dummy:tiny", sparsity=sparsity, max_model_len=1024, kv_cache_memory_gb=0.01)
    prompt = list(range(1, 201))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=300, ignore_eos=True))
    assert out.kv_tokens_per_group == {"full": 200, "budget40": 40}
    assert out.kv_tokens_held == {"full": 200 + 299, "budget40": 40 + 299}


def test_with_decode_eviction_a_sparse_layer_never_holds_more_than_its_budget():
    """The prefill keeps the budget less the decode window (40 - 16), the generated tokens fill
    the rest, then each replaces the oldest of them: 40 held at the end, in 3 blocks of a
    sparse layer instead of 22. Eight sequences of 200 + 300 tokens then run at once in a pool
    of 600 one-layer blocks (53 each at the end: 32 whole, 7 x 3 sparse) where without
    eviction they need 186 each and preempt one another."""
    prompt = list(range(1, 201))
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    held, preemptions, most_running = {}, {}, {}
    for eviction in (False, True):
        sparsity = SparsityConfig(
            policy="snapkv", budget=40, window=8, sinks=2, full_layers=1,
            decode_eviction=eviction, decode_window=16,
        )  # fmt: skip
        # 8 layers of the tiny model in float32: 4 KiB per one-layer block of 16 tokens.
        llm = LLM("dummy:tiny", sparsity=sparsity, max_model_len=1024, block_size=16,
                  kv_cache_memory_gb=600 * 4096 / 2**30, hf_overrides={"num_hidden_layers": 8})  # fmt: skip
        engine = llm.engine
        assert engine.scheduler.block_manager.pool.num_blocks == 600
        for i in range(8):
            engine.add_request(f"r{i}", prompt, params)
        most, finished = 0, []
        while engine.has_unfinished:
            finished += [out for out in engine.step() if out.finished]
            engine.check_invariants()
            most = max(most, engine.stats().num_running)
        held[eviction] = finished[0].kv_tokens_held
        preemptions[eviction] = engine.stats().num_preemptions
        most_running[eviction] = most
    assert held[False] == {"full": 200 + 299, "budget40": 40 + 299}
    assert held[True] == {"full": 200 + 299, "budget40": 40}
    assert preemptions[True] == 0 and most_running[True] == 8, (preemptions, most_running)
    assert preemptions[False] > 0, preemptions


def test_full_layers_list_keeps_exactly_those_layers_whole():
    llm = LLM(
        "dummy:tiny",
        sparsity=SparsityConfig(policy="snapkv", budget=48, window=8, full_layers=[1, 6, 3]),
        hf_overrides={"num_hidden_layers": 8},
        max_model_len=1024,
        kv_cache_memory_gb=0.02,
    )
    engine = llm.engine
    plan = engine.retention.layer_plan
    assert [g.name for g in plan.groups] == ["full", "budget48"]
    assert plan.groups[0].layers == (1, 3, 6)
    assert plan.groups[1].layers == (0, 2, 4, 5, 7)
    # 3 and 5 layers: blocks of one layer, eight KV groups.
    kv_groups = engine.plan.groups
    assert [g.name for g in kv_groups] == ["full"] * 3 + ["budget48"] * 5
    engine.add_request("a", list(range(1, 301)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()  # prefill: compress-on-write happens here
    usage = engine.stats().kv_blocks
    assert usage["full"]["used"] == 3 * cdiv(300, 16)
    assert usage["budget48"]["used"] == 5 * cdiv(48, 16)  # never held the whole prompt
    # Each layer's cache: full layers hold the prompt's 300 tokens, the others only 48.
    seq = engine.sequences["a"]
    assert seq.kv_lens == [300 if g.whole else 48 for g in kv_groups]
    while engine.has_unfinished:
        engine.step()


def test_pyramid_budgets_decrease_with_depth_in_a_few_tiers():
    llm = LLM(
        "dummy:tiny",
        sparsity=SparsityConfig(
            policy="pyramid", budget=128, window=8, full_layers=2, pyramid_tiers=3
        ),
        hf_overrides={"num_hidden_layers": 14},
        max_model_len=1024,
        kv_cache_memory_gb=0.02,
    )
    groups = llm.engine.retention.layer_plan.groups
    budgets = [g.budget for g in groups[1:]]
    assert groups[0].layers == (0, 1)
    assert len(budgets) == 3 and budgets == sorted(budgets, reverse=True)
    # Deeper tiers hold deeper layers, and the mean budget over sparse layers stays ~128.
    assert max(groups[1].layers) < min(groups[2].layers) < min(groups[3].layers)
    mean = sum(g.budget * len(g.layers) for g in groups[1:]) / 12
    assert abs(mean - 128) <= 2
    out = llm.generate([list(range(1, 400))], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.kv_tokens_per_group == {"full": 399, **{g.name: g.budget for g in groups[1:]}}


def test_the_model_is_built_in_its_dtype_and_rope_tables_stay_float32():
    """Built directly in bfloat16 (tests/test_gpu_engine.py checks the memory that saves); the
    RoPE tables hold bfloat16-rounded values in float32, as when the model was cast after a
    float32 build, and the default dtype is left as it was."""
    llm = LLM("dummy:tiny", dtype="bfloat16", kv_cache_memory_gb=0.01, max_model_len=256)
    model = llm.engine.runner.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    rotary = model.model.rotary
    freqs = torch.outer(torch.arange(256, dtype=torch.float32), rope_inv_freq(model.config))
    for table, exact in ((rotary.cos, freqs.cos()), (rotary.sin, freqs.sin())):
        assert table.dtype == torch.float32
        assert torch.equal(table, exact.to(torch.bfloat16).float())
    assert torch.get_default_dtype() == torch.float32
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
