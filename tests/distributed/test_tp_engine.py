"""Tensor parallelism over 2 CPU processes (gloo) on a random model whose heads divide by 2:
the same computation as one process, sparsity included, and compression issues no collective."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.models.config import DUMMY_PRESETS
from tests.distributed.tp_helpers import Run, assert_same_logits, run

TINY = DUMMY_PRESETS["tiny"]  # 4 layers, 4 heads, 2 KV heads, intermediate 128, vocab 512
PROMPTS = [[(7 * i + 3) % 500 + 1 for i in range(150)], [(11 * i) % 500 + 1 for i in range(90)]]
LATE_PROMPTS = [[(13 * i) % 500 + 1 for i in range(70)]]  # joins the decodes in a mixed step
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SNAPKV = SparsityConfig(policy="snapkv", budget=64, window=8, sinks=2, full_layers=1)
# name -> (sparsity, other engine arguments)
POLICIES = {
    "dense": (SparsityConfig(policy="dense"), {}),
    "snapkv": (SNAPKV, {}),
    "random": (
        SparsityConfig(policy="random", budget=64, window=8, sinks=2, full_layers=1),
        {},
    ),
    # Every rank quantizes its own KV heads into its FP8 pages.
    "snapkv-fp8-kv": (SNAPKV, {"kv_cache_dtype": "fp8"}),
    # Gemma 3's layout: every rank's local layers hold their window (32) of its heads.
    "gemma3-snapkv": (SNAPKV, {"model": "dummy:gemma3-tiny"}),
}


def engine_run(policy: str, tp: int) -> Run:
    sparsity, engine_args = POLICIES[policy]
    engine_args = {"model": "dummy:tiny", **engine_args}
    with LLM(
        sparsity=sparsity,
        max_model_len=512,
        kv_cache_memory_gb=0.01,
        block_size=16,  # the default on CPU; a CUDA host would get 128
        tensor_parallel_size=tp,
        **engine_args,
    ) as llm:
        result = run(llm, PROMPTS, PARAMS, late=LATE_PROMPTS)
        if tp > 1:
            assert [p.is_alive() for p in llm.engine.workers.processes] == [True]
            workers = llm.engine.workers.processes
    if tp > 1:  # shut down: no process left behind
        assert [p.exitcode for p in workers] == [0]
        assert not torch.distributed.is_initialized()
    return result


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int], Run]:
    return {(policy, tp): engine_run(policy, tp) for policy in POLICIES for tp in (1, 2)}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_tp2_computes_what_one_rank_computes(runs, policy):
    single, tp2 = runs[policy, 1], runs[policy, 2]
    assert_same_logits(single, tp2, atol=1e-5)
    assert tp2.token_ids == single.token_ids
    assert tp2.kv_tokens_per_group == single.kv_tokens_per_group


def test_sparse_runs_compress(runs):
    for policy in ("snapkv", "random"):
        kept = runs[policy, 2].kv_tokens_per_group
        assert kept == [
            {"full": 150, "budget64": 64},
            {"full": 90, "budget64": 64},
            {"full": 70, "budget64": 64},  # compressed in a mixed step
        ]


def test_gemma3s_local_layers_keep_their_window_on_every_rank(runs):
    """Its global layers: one whole, one at snapkv's budget; the local ones: their window."""
    kept = runs["gemma3-snapkv", 2].kv_tokens_per_group
    assert kept == [{"full": n, "budget64": 64, "sliding32": 32} for n in (150, 90, 70)]


def test_each_rank_caches_only_its_kv_heads(runs):
    (shapes,) = runs["snapkv", 2].worker_kv_shapes  # one worker rank
    assert len(shapes) == TINY.num_hidden_layers
    for _blocks, block_size, kv_heads, head_dim in shapes:
        assert (block_size, kv_heads, head_dim) == (16, TINY.num_key_value_heads // 2, 16)


def test_compression_issues_no_collective(runs):
    """A prefill step that compresses issues exactly the collectives of a dense one: one
    all-reduce for the embedding, two per layer (attention and MLP outputs), one all-gather of
    the logits, on every rank."""
    expected = {"all_reduce": 1 + 2 * TINY.num_hidden_layers, "all_gather": 1}
    dense = runs["dense", 2].prefill_calls
    assert dense == [expected, expected]  # rank 0 and rank 1
    for policy in ("snapkv", "random"):
        assert runs[policy, 2].prefill_calls == dense
    assert runs["dense", 1].prefill_calls == [{}]  # one rank: none at all


def test_one_tp_engine_per_process():
    with LLM("dummy:tiny", kv_cache_memory_gb=0.01, tensor_parallel_size=2) as llm:
        with pytest.raises(RuntimeError, match="already drives a tensor-parallel engine"):
            LLM("dummy:tiny", kv_cache_memory_gb=0.01, tensor_parallel_size=2)
        out = llm.generate([PROMPTS[1]], PARAMS)[0]
        assert len(out.token_ids) == 8


def test_cli_generate_on_two_ranks_exits_cleanly():
    """The CLI never calls shutdown: the workers stop when the interpreter exits."""
    args = "generate Hi --model dummy:tiny --policy dense --tensor-parallel-size 2 --max-tokens 4"
    args += " --ignore-eos --max-model-len 256 --kv-cache-memory-gb 0.01"
    proc = subprocess.run(
        [sys.executable, "-m", "sparse_core.cli", *args.split()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert '"completion_tokens": 4' in proc.stderr
