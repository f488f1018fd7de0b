"""Steps that prefill, split into the pieces between attentions that CUDA graphs capture: run
eagerly on CPU (tests/test_gpu_engine.py replays them as graphs), they generate what the plain
forward pass does, padding rows included."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.config import EngineConfig
from sparse_core.engine.piecewise_graphs import PiecewiseGraphs, token_buckets
from sparse_core.models.loader import load_model_source

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_token_buckets():
    assert token_buckets(40) == [1, 8, 16, 32, 40]
    buckets = token_buckets(2048)
    assert buckets[:6] == [1, 8, 16, 32, 64, 128]
    assert buckets[-1] == 2048 and all(b - a <= 64 for a, b in itertools.pairwise(buckets))
    assert token_buckets(100) == [1, 8, 16, 32, 64, 100]


@pytest.mark.parametrize("policy", ["dense", "snapkv"])
def test_pieces_generate_what_the_forward_pass_does(policy):
    """SmolLM2 in float32, prompts whole and in chunks beside running decodes: the step's tokens
    go through buckets of up to 256 (with padding rows), longer steps through the plain pass."""
    source = load_model_source("smollm2-135m-instruct", {})
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (300, 45, 130, 220)]
    sparsity = SparsityConfig(policy=policy, budget=64, window=8)

    def generate(piecewise: bool):
        llm = LLM(
            sparsity=sparsity,
            model_source=source,
            device="cpu",
            max_model_len=512,
            kv_cache_memory_gb=0.05,
            enable_chunked_prefill=True,
            max_num_batched_tokens=200,
        )
        runner = llm.engine.runner
        if piecewise:
            runner.prefill_graphs = PiecewiseGraphs(runner.model, 256, runner.device)
        llm.engine.step_records = []
        outputs = llm.generate(prompts, GREEDY)
        return outputs, llm.engine.step_records

    plain, _ = generate(piecewise=False)
    pieces, records = generate(piecewise=True)
    for a, b in zip(plain, pieces, strict=True):
        assert b.token_ids == a.token_ids
        assert b.kv_tokens_per_group == a.kv_tokens_per_group
    tokens = [r.num_prefill_tokens + r.num_decode_seqs for r in records if r.is_prefill]
    assert any(t not in token_buckets(256) for t in tokens)  # steps that ran padded


def test_the_pieces_fill_the_static_buffers_row_by_row():
    """Hidden states of the first T rows do not depend on what the padding rows hold."""
    llm = LLM("dummy:tiny", device="cpu", max_model_len=256, kv_cache_memory_gb=0.01)
    runner = llm.engine.runner
    graphs = PiecewiseGraphs(runner.model, 64, runner.device)
    vocab = runner.model.config.vocab_size
    graphs.input_ids.random_(0, vocab)
    for piece in range(runner.model.num_pieces):
        graphs.run_piece(piece, 64)
    first = graphs.hidden[:40].clone()
    graphs.input_ids[40:].random_(0, vocab)
    graphs.attn_out[40:].normal_()
    graphs.residual[40:].normal_()
    for piece in range(runner.model.num_pieces):
        graphs.run_piece(piece, 64)
    torch.testing.assert_close(graphs.hidden[:40], first, rtol=0, atol=0)


def test_default_graph_sizes_cover_every_chunked_step_and_short_prompts_otherwise():
    assert EngineConfig(max_model_len=4608).max_prefill_graph_tokens == 512
    chunked = EngineConfig(enable_chunked_prefill=True, max_num_batched_tokens=1024)
    assert chunked.max_prefill_graph_tokens == 1024 + 64  # and max_num_seqs decode rows
    full = EngineConfig(enable_chunked_prefill=True, max_num_batched_tokens=2048)
    assert full.max_prefill_graph_tokens == 2048 + 64
    large = EngineConfig(enable_chunked_prefill=True, max_num_batched_tokens=4096)
    assert large.max_prefill_graph_tokens == 2048
    assert EngineConfig(max_prefill_graph_tokens=0).max_prefill_graph_tokens == 0
    with pytest.raises(ValueError, match="max_prefill_graph_tokens"):
        EngineConfig(max_prefill_graph_tokens=-1)
