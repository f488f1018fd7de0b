"""SmolLM2 through stock vLLM with the plugin: greedy outputs and vLLM's own free-block count.

One vLLM engine per configuration (about 25 s each on 2 cores). Prompts: two short ones and two
500-token passkey prompts from the accuracy suite, fed as token ids so every engine sees the
same tokens.
"""

from __future__ import annotations

import pytest

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.eval.tasks import TaskBuilder
from tests.vllm_plugin.conftest import ENGINE_ARGS, MODEL
from tests.vllm_plugin.helpers import Run, run_steps

pytest.importorskip("vllm")
from sparse_core.vllm_plugin.engine import vllm_llm
from sparse_core.vllm_plugin.kv_spec import gap_blocks

MAX_TOKENS = 24
MAX_MODEL_LEN = 1024
BLOCK = ENGINE_ARGS["block_size"]
# Budget well below the 500-token prompts; the first 3 layers stay whole.
SPARSE = SparsityConfig(policy="snapkv", budget=96, window=16, sinks=4, full_layers=3)
# The same layer groups, with a budget no prompt reaches: nothing is compressed.
ROOMY = SparsityConfig(policy="snapkv", budget=MAX_MODEL_LEN, window=16, sinks=4, full_layers=3)


@pytest.fixture(scope="module")
def prompts(model_source) -> list[list[int]]:
    tok = model_source.tokenizer
    short = [tok.encode(t) for t in ("The capital of France is", "Write a haiku about rain.")]
    long = [s.prompt_ids for s in TaskBuilder(tok, seed=0).build("passkey", 500, 2)]
    return short + long


def _run(sparsity: SparsityConfig | None, prompts: list[list[int]], **engine_args) -> Run:
    args = {**ENGINE_ARGS, **engine_args}
    with vllm_llm(MODEL, sparsity, max_model_len=MAX_MODEL_LEN, **args) as llm:
        return run_steps(llm, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def stock(prompts) -> Run:
    return _run(None, prompts)


@pytest.fixture(scope="module")
def roomy(prompts) -> Run:
    return _run(ROOMY, prompts)


@pytest.fixture(scope="module")
def sparse(prompts) -> Run:
    return _run(SPARSE, prompts)


def test_stock_vllm_runs_its_own_attention(stock):
    assert stock.backends == {"CPUAttentionBackendImpl"}
    assert {g[0] for g in stock.groups} == {"FullAttentionSpec"}


def test_dense_through_the_plugin_is_stock_vllm(prompts, stock):
    """With no layer to compress the plugin stays out of the way: vLLM's own attention and
    settings, so the outputs are stock vLLM's on any device (the plugin's kernels over
    uncompressed layers are checked by the next test)."""
    dense = _run(SparsityConfig(policy="dense"), prompts)
    assert dense.backends == stock.backends
    assert dense.groups == stock.groups
    assert dense.token_ids == stock.token_ids


def test_budget_at_least_the_prompt_keeps_every_token(stock, roomy):
    assert roomy.backends == {"KVSparseAttentionImpl"}
    assert roomy.groups[0] == ("FullAttentionSpec", None, 3)
    assert {g[:2] for g in roomy.groups[1:]} == {("BudgetAttentionSpec", MAX_MODEL_LEN)}
    assert roomy.token_ids == stock.token_ids


def test_sparse_groups_free_the_dropped_blocks_while_decoding(prompts, roomy, sparse):
    # Same layer groups in both engines (1 full + 9 budget groups of 3 layers), so the same
    # block pool; only the budget differs.
    assert [g[0] for g in sparse.groups] == [g[0] for g in roomy.groups]
    sparse_groups = sum(g[0] == "BudgetAttentionSpec" for g in sparse.groups)
    freed_per_group = sum(len(gap_blocks(SPARSE.budget, len(p), BLOCK)) for p in prompts)
    assert freed_per_group > 0
    # vLLM's free-block count while every request decodes: from its second generated token (the
    # gap is freed when the step after the prompt's is scheduled) until one finishes. Its
    # highest value comes right after the gaps are freed, before decoding allocates more; the
    # two engines differ there by the gap blocks of every prompt in every budget group. (Runs
    # are lined up by progress, not step: the client may fetch two engine steps at once.)
    highest = []
    for run in (roomy, sparse):
        decoding = [
            free for key, free in run.free_blocks.items() if min(key) >= 2 and max(key) < MAX_TOKENS
        ]
        assert len(decoding) >= 3
        highest.append(max(decoding))
    assert highest[1] - highest[0] == sparse_groups * freed_per_group


def _native(
    sparsity: SparsityConfig, prompts: list[list[int]], kv_cache_dtype: str = "auto"
) -> list[list[int]]:
    native = LLM(
        model=MODEL,
        sparsity=sparsity,
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        kv_cache_memory_gb=0.25,
        kv_cache_dtype=kv_cache_dtype,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in native.generate(prompts, params)]


def test_sparse_outputs_match_the_native_engine(prompts, stock, sparse):
    expected = _native(SPARSE, prompts)
    # The budget changes the long prompts' continuations (else this test would prove nothing)...
    assert sparse.token_ids[2:] != stock.token_ids[2:]
    # ...and short prompts, within the budget, decode exactly as dense.
    assert sparse.token_ids[:2] == stock.token_ids[:2]
    assert sparse.token_ids == expected


def test_fp8_kv_cache_matches_the_native_engines(prompts, sparse):
    """vLLM's `kv_cache_dtype="fp8"`: every group's cache in e4m3 (a byte per value), written
    and read by the native engine's FP8 KV kernels at vLLM's scales of 1.0."""
    fp8 = _run(SPARSE, prompts, kv_cache_dtype="fp8")
    assert fp8.backends == {"KVSparseAttentionImpl"}
    assert [g[:2] for g in fp8.groups] == [g[:2] for g in sparse.groups]
    # The same KV memory holds four times the float32 cache's blocks (to vLLM's rounding).
    assert fp8.num_gpu_blocks // sparse.num_gpu_blocks == 4
    # A cache read or written as anything but e4m3 at these scales would not give the native
    # engine's tokens. (On these prompts e4m3's rounding changes none of float32's.)
    assert fp8.token_ids == _native(SPARSE, prompts, kv_cache_dtype="fp8")


def test_an_fp8_kv_cache_of_another_format_is_refused_at_start_up(prompts):
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported"):
        _run(SPARSE, prompts[:1], kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize(
    "sparsity",
    [
        # Four budget tiers: vLLM groups layers of equal budget, with padding layers.
        SparsityConfig(policy="pyramid", budget=128, window=16, sinks=4, full_layers=3),
        SparsityConfig(policy="streamingllm", budget=96, sinks=4, full_layers=3),
    ],
    ids=lambda s: s.policy,
)
def test_other_policies_match_the_native_engine(prompts, stock, sparsity):
    long = prompts[2:]
    run = _run(sparsity, long)
    assert len({g[1] for g in run.groups if g[1] is not None}) == (
        sparsity.pyramid_tiers if sparsity.policy == "pyramid" else 1
    )
    assert run.token_ids != stock.token_ids[2:]
    assert run.token_ids == _native(sparsity, long)
