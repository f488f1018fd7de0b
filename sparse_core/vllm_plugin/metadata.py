"""Per-step attention metadata of one KV cache group, built from vLLM's common metadata.

Each request row of a step is either a whole prompt (chunked prefill and prefix caching are off
while the plugin is active) or one decode token. Decode reads its context through a table
(decode_tables.py): a full group's block table, in pages of block_size tokens; in a sparse
group the cache slot of every token it attends to (pages of one token): for a compacted request
the kept tokens at positions [0, budget) followed by the generated tokens at [n, seq_len); the
gap in between is never read, so its blocks can be freed. The tables are built on the device,
from the block table vLLM already put there; the row lengths and the sparse groups' first blocks
are read back to the host once per group and step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata

from sparse_core.vllm_plugin.decode_tables import context_slot_table
from sparse_core.vllm_plugin.kv_spec import BudgetAttentionSpec


@dataclass
class KVSparseMetadata:
    num_actual_tokens: int
    budget: int | None  # None: a full group
    # Where each token of the step is stored; -1 for prompt tokens that are stored compacted.
    store_slots: torch.Tensor
    # Prompts: their tokens gathered and packed ([P] indices into the step), cu_seqlens over them.
    prefill_index: torch.Tensor
    prefill_cu_seqlens: torch.Tensor
    prefill_max_len: int
    # Prompts longer than the budget: [start, end) in the packed prompt tokens, and the slots of
    # positions [0, budget) of each, where its kept tokens go.
    compress_bounds: list[tuple[int, int]]
    kept_slots: torch.Tensor
    # Decode tokens: [D] indices into the step, their context tables [D, max_pages] in pages of
    # `decode_page_size` tokens, and their context lengths.
    decode_index: torch.Tensor
    decode_table: torch.Tensor
    decode_page_size: int
    decode_context_lens: torch.Tensor
    decode_max_len: int


class KVSparseMetadataBuilder(AttentionMetadataBuilder[KVSparseMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.budget = (
            kv_cache_spec.budget if isinstance(kv_cache_spec, BudgetAttentionSpec) else None
        )
        self.block_size = kv_cache_spec.block_size
        # Prompt length of each live request, keyed by its first block in this group (a block
        # belongs to one request at a time, and the first block is never freed). Decode steps
        # need it to skip the gap; vLLM's common metadata does not carry it.
        self.prompt_len_by_first_block: dict[int, int] = {}

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KVSparseMetadata:
        cm = common_attn_metadata
        num_tokens = cm.num_actual_tokens
        device = self.device
        starts = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
        seq_lens = cm.seq_lens[: cm.num_reqs].tolist()
        block_table = cm.block_table_tensor[: cm.num_reqs]
        # First blocks key the prompt lengths; a full group needs none.
        first_blocks = block_table[:, 0].tolist() if self.budget is not None else []
        slot_mapping = cm.slot_mapping[:num_tokens]
        prefill_rows: list[tuple[int, int]] = []
        compress_bounds: list[tuple[int, int]] = []
        compressed_rows: list[tuple[int, int]] = []
        kept_slots: list[torch.Tensor] = []
        decode_tokens: list[int] = []
        decode_rows: list[int] = []
        packed = 0
        for row in range(cm.num_reqs):
            start, end = starts[row], starts[row + 1]
            num_new, seq_len = end - start, seq_lens[row]
            if num_new == 0:
                continue
            if num_new == seq_len:
                if self.budget is not None:
                    self.prompt_len_by_first_block[first_blocks[row]] = seq_len
                prefill_rows.append((start, end))
                if self.budget is not None and seq_len > self.budget:
                    compress_bounds.append((packed, packed + seq_len))
                    compressed_rows.append((start, end))
                    kept_slots.append(slot_mapping[start : start + self.budget])
                packed += seq_len
            elif num_new == 1:
                decode_tokens.append(start)
                decode_rows.append(row)
            else:
                raise NotImplementedError(
                    "kvsparse: a step continued a partly computed prompt (chunked prefill, "
                    "prefix caching or speculative decoding); the plugin needs whole prompts"
                )
        store_slots = slot_mapping.long()
        if compressed_rows:
            # A compressed prompt's tokens are stored by the compaction, not here.
            store_slots = store_slots.clone()
            for start, end in compressed_rows:
                store_slots[start:end] = -1
        prefill_index = torch.cat(
            [torch.arange(s, e) for s, e in prefill_rows] or [torch.empty(0, dtype=torch.long)]
        )
        lengths = torch.tensor([e - s for s, e in prefill_rows], dtype=torch.int32)
        cu_seqlens = torch.zeros(len(prefill_rows) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lengths, 0)
        decode_seq_lens = [seq_lens[r] for r in decode_rows]
        decode_first_blocks = [first_blocks[r] for r in decode_rows] if first_blocks else []
        table, page_size, context_lens = self._decode_tables(
            block_table, decode_rows, decode_seq_lens, decode_first_blocks
        )
        return KVSparseMetadata(
            num_actual_tokens=num_tokens,
            budget=self.budget,
            store_slots=store_slots,
            prefill_index=prefill_index.to(device),
            prefill_cu_seqlens=cu_seqlens.to(device),
            prefill_max_len=int(lengths.max()) if len(lengths) else 0,
            compress_bounds=compress_bounds,
            kept_slots=torch.cat(kept_slots)
            if kept_slots
            else torch.empty(0, dtype=torch.long, device=device),
            decode_index=torch.tensor(decode_tokens, dtype=torch.long).to(device),
            decode_table=table,
            decode_page_size=page_size,
            decode_context_lens=context_lens.to(device),
            decode_max_len=int(context_lens.max()) if len(context_lens) else 0,
        )

    def _decode_tables(
        self,
        block_table: torch.Tensor,
        rows: list[int],
        seq_lens: list[int],
        first_blocks: list[int],
    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        """(table, page size, context lengths) of the decode rows."""
        device = block_table.device
        rows_table = block_table[torch.tensor(rows, dtype=torch.long).to(device)]
        if self.budget is None or not rows:
            return rows_table, self.block_size, torch.tensor(seq_lens, dtype=torch.int32)
        kept: list[int] = []
        skipped: list[int] = []
        for first_block, seq_len in zip(first_blocks, seq_lens, strict=True):
            prompt_len = self.prompt_len_by_first_block.get(first_block)
            if prompt_len is None or prompt_len >= seq_len:
                # No prompt recorded for this first block, or one that cannot be this request's
                # (a decode row is longer than its prompt): reading its gap would be wrong.
                raise RuntimeError(
                    "kvsparse: a decode step for a request whose prompt this worker never saw"
                )
            kept.append(min(prompt_len, self.budget))
            skipped.append(prompt_len - kept[-1])
        context_lens = torch.tensor(seq_lens, dtype=torch.int32) - torch.tensor(skipped)
        table = context_slot_table(
            rows_table,
            self.block_size,
            torch.tensor(kept, dtype=torch.long).to(device),
            torch.tensor(skipped, dtype=torch.long).to(device),
            int(context_lens.max()),
        )
        return table, 1, context_lens.to(torch.int32)
