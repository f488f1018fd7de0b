"""Decode steps that vLLM replays as CUDA graphs: the metadata builder gives them the capture's
shape (every row of the padded batch, contexts bounded by max_model_len) in buffers at fixed
addresses, and what they read is the same context as the per-step metadata's.

The builder is driven directly with vLLM's own metadata types, as vLLM's GPU model runner fills
them for a padded decode batch (padded rows: no token, sequence length 0, the null block, slot
-1); vLLM's CPU build captures no graphs, so its engine never takes this path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparse_core.kernels import reference as ref

pytest.importorskip("vllm")
from vllm.config import CUDAGraphMode
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from sparse_core.vllm_plugin.decode_tables import pages_of
from sparse_core.vllm_plugin.kv_spec import BudgetAttentionSpec
from sparse_core.vllm_plugin.metadata import KVSparseMetadataBuilder

BLOCK, NUM_BLOCKS, MAX_SEQS, MAX_LEN, BUDGET = 8, 64, 8, 64, 12
NUM_KV, NUM_Q, HEAD = 2, 4, 16
SPEC = {"block_size": BLOCK, "num_kv_heads": NUM_KV, "head_size": HEAD, "dtype": torch.float32}
# Request 0: a 30-token prompt (compacted in a sparse group), request 1: 10 tokens (kept whole);
# block tables are max_model_len / BLOCK wide, as vLLM's.
PROMPTS = [30, 10]
TABLES = torch.tensor([[5, 9, 2, 7, 11, 13, 0, 0], [3, 8, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
# vLLM's block table is one buffer of max_num_seqs rows; padded rows hold the null block 0.
STEP_TABLES = torch.cat([TABLES, torch.zeros(MAX_SEQS - len(PROMPTS), TABLES.shape[1])]).int()


def _builder(
    spec, graphs: bool = True, capture_size: int | None = None, num_blocks: int | None = NUM_BLOCKS
) -> KVSparseMetadataBuilder:
    mode = CUDAGraphMode.FULL_AND_PIECEWISE if graphs else CUDAGraphMode.NONE
    compilation = SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=capture_size)
    config = SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=num_blocks),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
        compilation_config=compilation,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=None,
    )
    return KVSparseMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))


def _step(new_tokens: list[int], seq_lens: list[int], tables: torch.Tensor, slots: list[int]):
    """vLLM's common metadata of a step: rows' new tokens and sequence lengths."""
    starts = torch.tensor([0, *new_tokens], dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=lens,
        num_reqs=len(seq_lens),
        num_actual_tokens=int(starts[-1]) if sum(new_tokens) else len(seq_lens),
        max_query_len=max(new_tokens),
        max_seq_len=max(seq_lens),
        block_table_tensor=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=lens,
    )


def _slot(row: int, position: int) -> int:
    return int(TABLES[row, position // BLOCK]) * BLOCK + position % BLOCK


def _prompt_step():
    slots = [_slot(r, p) for r, n in enumerate(PROMPTS) for p in range(n)]
    return _step(PROMPTS, PROMPTS, TABLES, slots)


def _decode_step(generated: int, padded_rows: int):
    """Both requests decode their `generated`-th token, in a batch padded to 2 + padded_rows."""
    seq_lens = [n + generated for n in PROMPTS] + [0] * padded_rows
    slots = [_slot(r, n + generated - 1) for r, n in enumerate(PROMPTS)] + [-1] * padded_rows
    step = _step([1, 1] + [0] * padded_rows, seq_lens, STEP_TABLES[: len(seq_lens)], slots)
    step.num_actual_tokens = len(seq_lens)  # vLLM pads the tokens with the rows
    return step


def _attend(metadata, cache: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return ref.paged_decode_attention(
        q,
        pages_of(cache, metadata.decode_page_size),
        pages_of(cache, metadata.decode_page_size),
        metadata.decode_table,
        metadata.decode_context_lens,
        1.0,
        metadata.decode_max_len,
    )


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse group", "full group"])
def test_graph_decode_reads_the_same_context_at_fixed_addresses(sparse: bool) -> None:
    spec = BudgetAttentionSpec(**SPEC, budget=BUDGET) if sparse else FullAttentionSpec(**SPEC)
    graphs, per_step = _builder(spec), _builder(spec, graphs=False)
    for builder in (graphs, per_step):
        builder.build(0, _prompt_step())
    cache = torch.randn(NUM_BLOCKS, BLOCK, NUM_KV, HEAD)
    q = torch.randn(4, NUM_Q, HEAD)
    addresses = set()
    for generated in (1, 2):
        step = _decode_step(generated, padded_rows=2)
        graph = graphs.build(0, step)
        unpadded = per_step.build(0, _decode_step(generated, padded_rows=0))
        assert graph.decode_tokens == slice(0, 4) and graph.num_prefill_tokens == 0
        assert graph.decode_max_len == MAX_LEN
        seen = _attend(unpadded, cache, q[:2])
        torch.testing.assert_close(_attend(graph, cache, q)[:2], seen)
        assert graph.decode_context_lens[2:].tolist() == [0, 0]
        expected = [min(n, BUDGET) + generated if sparse else n + generated for n in PROMPTS]
        assert graph.decode_context_lens[:2].tolist() == expected
        addresses.add((graph.decode_table.data_ptr(), graph.decode_context_lens.data_ptr()))
    assert len(addresses) == 1  # what a replay reads has not moved


def test_capture_and_its_warm_ups_are_decode_steps() -> None:
    """vLLM captures, and warms up before capturing, with one-token sequences: decode rows that
    attend to their one token, also in a block where a compacted prompt lived before."""
    builder = _builder(BudgetAttentionSpec(**SPEC, budget=BUDGET))
    builder.build(0, _prompt_step())  # request 0's first block now records a gap of 18
    capture = builder.build_for_cudagraph_capture(
        _step([1] * 4, [1] * 4, TABLES[[1] * 4], [-1] * 4)
    )
    assert capture.num_prefill_tokens == 0 and capture.decode_tokens == slice(0, 4)
    assert capture.decode_table.shape == (4, MAX_LEN)
    warm_up = builder.build(0, _step([1] * 4, [1] * 4, TABLES[[0] * 4], [_slot(0, 0)] * 4))
    assert warm_up.num_prefill_tokens == 0 and warm_up.decode_tokens == slice(0, 4)
    assert warm_up.decode_context_lens.tolist() == [1] * 4
    assert warm_up.decode_table[:, 0].tolist() == [_slot(0, 0)] * 4


def test_batches_larger_than_vllm_captures_take_the_per_step_metadata() -> None:
    builder = _builder(BudgetAttentionSpec(**SPEC, budget=BUDGET), capture_size=3)
    assert builder.graph_buffers is not None and builder.graph_buffers.rows == 3
    builder.build(0, _prompt_step())
    assert builder.build(0, _decode_step(1, padded_rows=1)).decode_max_len == MAX_LEN
    per_step = builder.build(0, _decode_step(1, padded_rows=2))
    assert per_step.decode_max_len == max(PROMPTS) + 1


def test_a_dummy_prompt_on_the_null_block_leaves_padded_rows_empty() -> None:
    """vLLM's dummy runs point their rows at the null block 0, which padded rows read too."""
    builder = _builder(BudgetAttentionSpec(**SPEC, budget=BUDGET))
    null_row = torch.zeros_like(TABLES[:1])
    builder.build(0, _step([30], [30], null_row, [-1] * 30))  # 30 > budget: a gap of 18
    builder.build(0, _prompt_step())
    graph = builder.build(0, _decode_step(1, padded_rows=2))
    assert graph.decode_context_lens.tolist() == [BUDGET + 1, PROMPTS[1] + 1, 0, 0]


def test_builders_made_before_vllm_sizes_the_cache_wait_for_it() -> None:
    """vLLM creates the builders of its CUDA-graph memory profile before it sets
    num_gpu_blocks; the gap record is made when a step first needs it."""
    builder = _builder(BudgetAttentionSpec(**SPEC, budget=BUDGET), num_blocks=None)
    with pytest.raises(RuntimeError, match="before its KV cache"):
        builder.build(0, _prompt_step())
    builder.vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    builder.build(0, _prompt_step())
    assert builder.gaps().shape == (NUM_BLOCKS,)
