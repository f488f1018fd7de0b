"""Token selection for a batch of prompts equals the per-prompt reference selection."""

from __future__ import annotations

import pytest
import torch

from sparse_core import LLM
from sparse_core.config import SparsityConfig
from sparse_core.kernels import REFERENCE_OPS
from sparse_core.kernels import reference as ref
from sparse_core.selection import PromptBatch, selection_policy


def reference_selection(sparsity: SparsityConfig, budget, q, k, start, end, scale):
    """The oracle: one prompt at a time, through the reference kernels."""
    n, window = end - start, sparsity.window
    keys = k[start:end]
    q_win = q[end - window : end]
    lse_win = ref.window_lse(q_win, keys, scale)
    scores = ref.window_scores(q_win, keys, lse_win, scale, sparsity.gqa_reduce)
    pooled = ref.pool_scores(scores, sparsity.pooling, sparsity.kernel_size)
    return ref.select_top_tokens(pooled, n, budget, window, sparsity.sinks) + start


@pytest.mark.parametrize("pooling", ["avg", "max", "none"])
@pytest.mark.parametrize("gqa_reduce", ["mean", "max"])
def test_batched_selection_equals_per_prompt_reference(pooling, gqa_reduce):
    torch.manual_seed(7)
    sparsity = SparsityConfig(
        policy="snapkv", budget=40, window=8, sinks=3, pooling=pooling, gqa_reduce=gqa_reduce
    )
    lengths = [41, 97, 64, 150]
    budgets = [40, 60, 40, 30]  # a budget per prompt, as a group keeping a ratio gives them
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    q, k = torch.randn(start, 6, 16), torch.randn(start, 2, 16)
    prompts = PromptBatch.from_bounds(bounds, budgets, k.device)
    kept = selection_policy(sparsity, REFERENCE_OPS).select(q, k, None, prompts, 0.25)
    assert kept.shape == (2, sum(budgets))
    first = 0
    for j, (s, e) in enumerate(bounds):
        expected = reference_selection(sparsity, budgets[j], q, k, s, e, 0.25)
        assert torch.equal(kept[:, first : first + budgets[j]], expected), j
        first += budgets[j]


def test_streamingllm_keeps_sinks_and_the_most_recent_tokens():
    sparsity = SparsityConfig(policy="streamingllm", budget=10, window=4, sinks=2)
    q, k = torch.randn(50, 2, 8), torch.randn(50, 2, 8)
    prompts = PromptBatch.from_bounds([(0, 20), (20, 50)], [10, 12], k.device)
    kept = selection_policy(sparsity, REFERENCE_OPS).select(q, k, None, prompts, 1.0)
    assert kept[0, :10].tolist() == [0, 1, *range(12, 20)]
    assert kept[1, 10:].tolist() == [20, 21, *range(40, 50)]


def test_random_policy_keeps_sinks_and_window_and_differs_per_head():
    sparsity = SparsityConfig(policy="random", budget=16, window=4, sinks=2)
    q, k = torch.randn(200, 4, 8), torch.randn(200, 2, 8)
    prompts = PromptBatch.from_bounds([(0, 200)], [16], k.device)
    kept = selection_policy(sparsity, REFERENCE_OPS).select(q, k, None, prompts, 1.0)
    for head in kept:
        assert head[:2].tolist() == [0, 1] and head[-4:].tolist() == [196, 197, 198, 199]
        assert len(set(head.tolist())) == 16
    assert not torch.equal(kept[0], kept[1])


def test_the_start_up_profile_leaves_the_random_policys_stream_where_serving_starts_it(
    monkeypatch,
):
    """The profile's step runs a policy of its own. It measures CUDA memory; on a CPU those
    counters are stubbed and the step runs as it would on a GPU."""
    for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 0)
    sparsity = SparsityConfig(policy="random", budget=24, window=4, sinks=2, full_layers=1)
    with LLM("dummy:tiny", max_model_len=128, kv_cache_memory_gb=0.01, sparsity=sparsity) as llm:
        runner = llm.engine.runner
        start = torch.Generator().manual_seed(sparsity.seed).get_state()
        runner.profile_activation_bytes()
        assert not torch.equal(runner.profile_selection.generator.get_state(), start)  # it drew
        assert torch.equal(runner.selection.generator.get_state(), start)
