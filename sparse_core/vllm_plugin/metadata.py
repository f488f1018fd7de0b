"""Per-step attention metadata of one KV cache group, built from vLLM's common metadata.

Each request row of a step is either a whole prompt (chunked prefill and prefix caching are off
while the plugin is active) or one decode token (step_rows.py). Decode reads its context through
a table (decode_tables.py): a full group's block table, in pages of block_size tokens; in a
sparse group the cache slot of every token it attends to (pages of one token): for a compacted
request the kept tokens at positions [0, budget) followed by the generated tokens at
[n, seq_len); the gap in between is never read, so its blocks can be freed.

Nothing here waits for the GPU: vLLM prepares a step while the previous one runs (async
scheduling), and a device-to-host read, or a copy from pageable host memory, would make it wait.
Row kinds come from vLLM's host copies of the query starts and sequence lengths; each sparse
group keeps the gap of every live request on the device, keyed by the request's first block; the
decode tables are built on the device from the block table vLLM already put there; the few host
values a step adds go over from page-locked memory without a sync.

Decode-only steps run as one CUDA graph per batch size (vLLM captures them when the builder
declares it, `_cudagraph_support`): a replay launches the kernels of the capture with the same
arguments, so such a step's metadata has the capture's shape (every row of the padded batch a
decode row, contexts bounded by max_model_len) and the tensors it reads are at fixed addresses:
vLLM's own step buffers (block table, slot mapping) or this builder's (GraphDecodeBuffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from sparse_core.transfers import to_device
from sparse_core.vllm_plugin.decode_tables import context_slot_table
from sparse_core.vllm_plugin.kv_spec import BudgetAttentionSpec
from sparse_core.vllm_plugin.step_rows import Index, StepRows, index_len, step_rows


@dataclass
class KVSparseMetadata:
    num_actual_tokens: int
    budget: int | None  # None: a full group
    # Where each token of the step is stored; -1 for prompt tokens that are stored compacted.
    store_slots: torch.Tensor
    # Prompts: their tokens in the step (a slice, or indices on the device), cu_seqlens over
    # them packed.
    prefill_tokens: Index
    prefill_cu_seqlens: torch.Tensor
    prefill_max_len: int
    # Prompts longer than the budget: [start, end) in the packed prompt tokens, and the slots of
    # positions [0, budget) of each, where its kept tokens go.
    compress_bounds: list[tuple[int, int]]
    kept_slots: torch.Tensor
    # Decode tokens: their place in the step (as prefill_tokens), their context tables
    # [D, max_pages] in pages of `decode_page_size` tokens, and their context lengths, of which
    # decode_max_len is an upper bound.
    decode_tokens: Index
    decode_table: torch.Tensor
    decode_page_size: int
    decode_context_lens: torch.Tensor
    decode_max_len: int

    @property
    def num_prefill_tokens(self) -> int:
        return index_len(self.prefill_tokens)

    @property
    def num_decodes(self) -> int:
        return index_len(self.decode_tokens)


@dataclass
class GraphDecodeBuffers:
    """What a decode step captured in a CUDA graph reads that vLLM does not keep at a fixed
    address: the context lengths of up to vLLM's largest captured batch of rows and, in a sparse
    group, their context slot tables, max_model_len wide (a sparse group's context is never
    longer)."""

    context_lens: torch.Tensor  # [rows] int32
    slots: torch.Tensor | None  # [rows, max_model_len] int32; None for a full group

    @classmethod
    def allocate(cls, rows: int, max_len: int, sparse: bool, device) -> GraphDecodeBuffers:
        slots = torch.zeros(rows, max_len, dtype=torch.int32, device=device) if sparse else None
        return cls(torch.zeros(rows, dtype=torch.int32, device=device), slots)

    @property
    def rows(self) -> int:
        return self.context_lens.shape[0]


class KVSparseMetadataBuilder(AttentionMetadataBuilder[KVSparseMetadata]):
    # vLLM puts requests of one new token first: decode and prompt tokens are then two slices.
    reorder_batch_threshold: int | None = 1
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.budget = (
            kv_cache_spec.budget if isinstance(kv_cache_spec, BudgetAttentionSpec) else None
        )
        self.block_size = kv_cache_spec.block_size
        self._gap_by_first_block: torch.Tensor | None = None  # see gaps()
        self.max_model_len = vllm_config.model_config.max_model_len
        self.graph_buffers: GraphDecodeBuffers | None = None
        if rows := _graph_decode_rows(vllm_config):
            sparse = self.budget is not None
            self.graph_buffers = GraphDecodeBuffers.allocate(
                rows, self.max_model_len, sparse, device
            )

    def gaps(self) -> torch.Tensor:
        """A sparse group's record, on the device, of the positions [budget, prompt length) that
        each live request's compacted prompt never stored, keyed by the request's first block
        in this group (a block belongs to one request at a time, and the first block is never
        freed); 0 for prompts stored whole, and for vLLM's null block, which padded and dummy
        rows point to. Every prompt sets its entry in the step that runs it: vLLM's common
        metadata carries no prompt lengths. Made on first use: vLLM creates builders before it
        sets the number of blocks when it profiles its CUDA graphs' memory."""
        if self._gap_by_first_block is None:
            num_blocks = self.vllm_config.cache_config.num_gpu_blocks
            if not num_blocks:
                raise RuntimeError("kvsparse: vLLM built attention metadata before its KV cache")
            self._gap_by_first_block = torch.zeros(
                num_blocks, dtype=torch.int32, device=self.device
            )
        return self._gap_by_first_block

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> KVSparseMetadata:
        # The capture's rows hold one token of a one-token sequence: they stand for decode rows.
        cm = common_attn_metadata
        return self._graph_decode(cm, _host_seq_lens(cm))

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KVSparseMetadata:
        cm = common_attn_metadata
        host_seq_lens = _host_seq_lens(cm)
        rows = step_rows(cm.query_start_loc_cpu[: cm.num_reqs + 1], host_seq_lens)
        block_table = cm.block_table_tensor[: cm.num_reqs]
        lengths = [end - start for start, end in rows.prompt_bounds]
        if self._fits_graph_buffers(cm):
            # One new token a row. A one-token prompt (vLLM's warm-ups before a capture are made
            # of them) is stored whole and attends to its own token, as a decode row does.
            self._record_gaps(block_table, rows, lengths)
            return self._graph_decode(cm, host_seq_lens)
        slot_mapping = cm.slot_mapping[: cm.num_actual_tokens]
        packed_starts = [0]
        for n in lengths:
            packed_starts.append(packed_starts[-1] + n)
        # Prompts longer than the budget, by their place among the step's prompts.
        compressed = [
            i for i, n in enumerate(lengths) if self.budget is not None and n > self.budget
        ]
        store_slots = slot_mapping.long()
        kept_slots: list[torch.Tensor] = []
        if compressed:
            # A compressed prompt's tokens are stored by the compaction, not here: its kept
            # tokens go to the slots of its positions [0, budget).
            store_slots = store_slots.clone()
            for i in compressed:
                start, end = rows.prompt_bounds[i]
                store_slots[start:end] = -1
                kept_slots.append(slot_mapping[start : start + self.budget])
        self._record_gaps(block_table, rows, lengths)
        table, page_size, context_lens, max_len = self._decode_tables(
            cm, block_table, rows, host_seq_lens
        )
        return KVSparseMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            budget=self.budget,
            store_slots=store_slots,
            prefill_tokens=self._on_device(rows.prompt_tokens),
            prefill_cu_seqlens=to_device(packed_starts, torch.int32, self.device),
            prefill_max_len=max(lengths, default=0),
            compress_bounds=[(packed_starts[i], packed_starts[i + 1]) for i in compressed],
            kept_slots=torch.cat(kept_slots) if kept_slots else slot_mapping[:0].long(),
            decode_tokens=self._on_device(rows.decode_tokens),
            decode_table=table,
            decode_page_size=page_size,
            decode_context_lens=context_lens,
            decode_max_len=max_len,
        )

    def _record_gaps(self, block_table: torch.Tensor, rows: StepRows, lengths: list[int]) -> None:
        """Set the gap of each of the step's prompts (`lengths` long) in a sparse group."""
        if self.budget is None or not rows.num_prompts:
            return
        first_blocks = block_table[self._on_device(rows.prompt_rows), 0]
        gaps = [max(0, n - self.budget) for n in lengths]
        record = self.gaps()
        record[first_blocks] = to_device(gaps, torch.int32, self.device)
        record[NULL_BLOCK_ID] = 0  # if a dummy run's prompt pointed there

    def _fits_graph_buffers(self, cm: CommonAttentionMetadata) -> bool:
        """A step of one new token per row (padded rows included) that the graph buffers hold:
        the shape vLLM replays as a captured graph."""
        buffers = self.graph_buffers
        return (
            buffers is not None
            and cm.max_query_len <= 1
            and cm.num_actual_tokens == cm.num_reqs <= buffers.rows
        )

    def _graph_decode(
        self, cm: CommonAttentionMetadata, host_seq_lens: torch.Tensor
    ) -> KVSparseMetadata:
        """A step of one new token per row with every row as a decode row, padded ones included
        (vLLM gives them sequence length 0, slot -1 and the null block: they read and write
        nothing), and contexts bounded by max_model_len, in the graph buffers. A sparse group's
        slot tables are filled as far as this step's longest sequence (`host_seq_lens`): decode
        reads no further."""
        buffers = self.graph_buffers
        assert buffers is not None
        num_rows = cm.num_reqs
        block_table = cm.block_table_tensor[:num_rows]
        seq_lens = cm.seq_lens[:num_rows]
        context_lens = buffers.context_lens[:num_rows]
        table, page_size = block_table, self.block_size
        if self.budget is None:
            context_lens.copy_(seq_lens)
        else:
            assert buffers.slots is not None
            table, page_size = buffers.slots[:num_rows], 1
            width = int(host_seq_lens.max()) if num_rows else 0
            slots, lens = self._sparse_contexts(block_table, seq_lens, width)
            table[:, :width].copy_(slots)
            context_lens.copy_(lens)
        slot_mapping = cm.slot_mapping[:num_rows]
        return KVSparseMetadata(
            num_actual_tokens=num_rows,
            budget=self.budget,
            store_slots=slot_mapping.long(),  # vLLM's are int64 already: no copy
            prefill_tokens=slice(0, 0),
            prefill_cu_seqlens=cm.query_start_loc[:1],
            prefill_max_len=0,
            compress_bounds=[],
            kept_slots=slot_mapping[:0].long(),
            decode_tokens=slice(0, num_rows),
            decode_table=table,
            decode_page_size=page_size,
            decode_context_lens=context_lens,
            decode_max_len=self.max_model_len,
        )

    def _decode_tables(
        self,
        cm: CommonAttentionMetadata,
        block_table: torch.Tensor,
        rows: StepRows,
        host_seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, int, torch.Tensor, int]:
        """(table, page size, context lengths, a bound on them) of the decode rows."""
        decode_rows = self._on_device(rows.decode_rows)
        rows_table = block_table[decode_rows]
        seq_lens = cm.seq_lens[: cm.num_reqs][decode_rows].to(torch.int32)
        max_len = int(host_seq_lens[rows.decode_rows].max()) if rows.num_decodes else 0
        if self.budget is None or not rows.num_decodes:
            return rows_table, self.block_size, seq_lens, max_len
        table, context_lens = self._sparse_contexts(rows_table, seq_lens, max_len)
        return table, 1, context_lens, max_len

    def _sparse_contexts(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In a sparse group, the slot tables [R, max_len] and int32 context lengths [R] of
        decode rows with these block tables and sequence lengths: each row's context skips the
        gap that its request's first block records."""
        gaps = self.gaps()[block_table[:, 0].long()]
        table = context_slot_table(block_table, self.block_size, self.budget, gaps, max_len)
        return table, (seq_lens - gaps).to(torch.int32)

    def _on_device(self, index: Index) -> Index:
        return index if isinstance(index, slice) else to_device(index, torch.long, self.device)


def _graph_decode_rows(vllm_config) -> int:
    """The most rows of a decode step that vLLM replays as a full CUDA graph; 0 without full
    graphs. Larger decode batches are not captured: they take the per-step metadata."""
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return 0
    rows = vllm_config.scheduler_config.max_num_seqs
    return min(rows, compilation.max_cudagraph_capture_size or rows)


def _host_seq_lens(cm: CommonAttentionMetadata) -> torch.Tensor:
    """The rows' sequence lengths on the host. vLLM's `seq_lens_cpu_upper_bound` is exact
    without speculative decoding, which the plugin does not support."""
    if cm.seq_lens_cpu_upper_bound is not None:
        return cm.seq_lens_cpu_upper_bound[: cm.num_reqs]
    return cm.seq_lens[: cm.num_reqs].cpu()
