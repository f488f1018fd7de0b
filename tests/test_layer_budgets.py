"""Per-layer budgets (SparsityConfig.layer_budgets): validation, pools, the engine, the shipped
profiles and the command-line flags."""

from __future__ import annotations

import logging

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.cli import build_parser
from sparse_core.engine_args import configs_from_args
from sparse_core.policy import (
    budget_profiles,
    load_profile,
    nearest_budget_profile,
    plan_layers,
    ratios_compression,
)

SMOLLM2 = "smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer_budgets": "auto"}, "needs target_compression"),
        ({"target_compression": 4.0}, "set layer_budgets='auto' with it"),
        ({"layer_budgets": [None, 64], "target_compression": 2.0}, "set layer_budgets='auto'"),
        ({"layer_budgets": "auto", "target_compression": 0.5}, "must be a number >= 1"),
        ({"layer_budgets": "some"}, "must be 'auto' or a list"),
        ({"layer_budgets": [None, 36]}, r"greater than window \(32\) \+ sinks \(4\)"),
        ({"layer_budgets": [None, 64.5]}, "ints greater than"),
        ({"layer_budgets": []}, "an empty list"),
        ({"layer_budgets": [None, 64], "policy": "pyramid"}, "'pyramid' both set"),
        ({"layer_budgets": [None, 64], "full_layers": 3}, "leave full_layers unset"),
    ],
)
def test_bad_layer_budgets(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparsityConfig(**{"policy": "snapkv", **kwargs})


def test_equal_budgets_share_a_pool():
    sparsity = SparsityConfig(policy="snapkv", layer_budgets=[None, 256, 64, 256, None, 64])
    plan = plan_layers(sparsity, 6, "any")
    assert [(g.name, g.layers) for g in plan.groups] == [
        ("full", (0, 4)),
        ("budget256", (1, 3)),
        ("budget64", (2, 5)),
    ]
    assert plan.layer_to_group == (0, 1, 2, 1, 0, 2)
    with pytest.raises(ValueError, match="layer_budgets has 6 entries; the model has 5 layers"):
        plan_layers(sparsity, 5, "any")


def test_engine_keeps_each_layers_budget():
    """Three layer groups on the real engine: each keeps its budget of a 300-token prompt,
    all in one pool, and a request the pool cannot hold is refused saying so."""
    sparsity = SparsityConfig(policy="snapkv", window=8, sinks=2, layer_budgets=[None, 64, 64, 32])
    llm = LLM("dummy:tiny", sparsity=sparsity, max_model_len=1024, kv_cache_memory_gb=0.0003)
    (out,) = llm.generate([list(range(1, 301))], SamplingParams(max_tokens=4, temperature=0.0))
    assert out.kv_tokens_per_group == {"full": 300, "budget64": 64, "budget32": 32}
    assert out.compression_ratio == pytest.approx(4 * 300 / (300 + 64 + 64 + 32))
    usage = llm.engine.stats().kv_blocks
    assert list(usage) == ["full", "budget64", "budget32"]
    # Four KV groups of one layer share the pool: 0.0003 GiB in float32 blocks of 16 tokens.
    assert {u["total"] for u in usage.values()} == {78}
    # 600 tokens in the whole layer, 364 in each budget64 one and 332 in budget32's: 38 +
    # 2 x 23 + 21 blocks.
    with pytest.raises(ValueError, match="needs 105 KV blocks, and the cache has 78"):
        llm.generate([list(range(1, 301))], SamplingParams(max_tokens=300))


def test_auto_picks_the_nearest_shipped_profile(caplog):
    """The profile's ratios are the groups: one per tier, each keeping its share of a prompt of
    any length, so the plan compresses as asked at every length."""
    with caplog.at_level(logging.INFO, logger="sparse_core.policy"):
        sparsity = SparsityConfig(policy="snapkv", layer_budgets="auto", target_compression=3.8)
        plan = plan_layers(sparsity, 30, SMOLLM2)
    assert "calibrated for 4x (4x.json)" in caplog.text
    tiers = set(nearest_budget_profile(SMOLLM2, 3.8).layer_ratios)  # None: whole
    assert len(plan.groups) == len(tiers)  # each tier one pool
    for n in (1000, 2000, 4000, 8000):
        kept = sum(len(g.layers) * g.kept_tokens(n) for g in plan.groups)
        assert 30 * n / kept == pytest.approx(4.0, rel=0.01), n
    # vLLM's plugin fixes a budget per group, at the length it is told to expect.
    fixed = plan.at_length(4000)
    assert {g.budget for g in fixed.groups} == {
        None,
        *(g.kept_tokens(4000) for g in plan.groups[1:]),
    }
    assert fixed.layer_to_group == plan.layer_to_group


def test_calibrated_ratios_compress_as_asked_at_every_prompt_length():
    """The engine on SmolLM2 with the 4x profile: each request keeps its share of its own
    prompt in every sparse layer, so its compression is 4x at 1k to 8k tokens (budgets sized
    for one length gave 2.53x at 2k)."""
    sparsity = SparsityConfig(policy="snapkv", layer_budgets="auto", target_compression=4.0)
    llm = LLM(sparsity=sparsity, max_model_len=8192, kv_cache_memory_gb=0.5)
    lengths = [1000, 2000, 4000, 8000]
    prompts = [[1 + (7 * i) % 40000 for i in range(n)] for n in lengths]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    groups = llm.engine.plan.groups
    for n, out in zip(lengths, outs, strict=True):
        assert out.compression_ratio == pytest.approx(4.0, rel=0.05), n
        assert out.kv_tokens_per_group == {g.name: g.kept_tokens(n) for g in groups}
        assert out.kv_tokens_per_group["ratio8"] == -(-n // 8)


def test_auto_without_profiles_says_so():
    sparsity = SparsityConfig(policy="snapkv", layer_budgets="auto", target_compression=4.0)
    with pytest.raises(ValueError, match="per-layer budget profiles for model 'dummy:tiny'"):
        LLM("dummy:tiny", sparsity=sparsity, kv_cache_memory_gb=0.001)


def test_shipped_profiles_meet_their_compression():
    profiles = budget_profiles(SMOLLM2)
    assert [p.target_compression for p in profiles] == [2.0, 3.0, 4.0]
    for p in profiles:
        assert len(p.layer_ratios) == 30
        assert ratios_compression(p.layer_ratios) >= p.target_compression * 0.999
        assert ratios_compression(p.layer_ratios) <= p.target_compression * 1.1


def _sparsity(*flags: str) -> SparsityConfig:
    return configs_from_args(build_parser().parse_args(["generate", "hi", *flags]))[1]


def test_command_line_flags():
    auto = _sparsity("--layer-budgets", "auto", "--target-compression", "4")
    assert (auto.layer_budgets, auto.target_compression, auto.full_layers) == ("auto", 4.0, None)
    listed = _sparsity("--layer-budgets", "none,64,None,48", "--model", "dummy:tiny")
    assert listed.layer_budgets == [None, 64, None, 48]
    assert _sparsity().full_layers is None  # unset without layer budgets: the engine resolves it
    plan = plan_layers(_sparsity("--policy", "snapkv"), 30, SMOLLM2)  # SmolLM2's profile
    assert plan.source == "calibrated" and plan.full_layers == load_profile(SMOLLM2)["full_layers"]
    with pytest.raises(ValueError, match="leave full_layers unset"):
        _sparsity("--layer-budgets", "auto", "--target-compression", "4", "--full-layers", "2")


def test_a_bad_layer_budget_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        _sparsity("--layer-budgets", "64,half")
    assert "--layer-budgets: '64,half' is not a comma-separated list" in capsys.readouterr().err
