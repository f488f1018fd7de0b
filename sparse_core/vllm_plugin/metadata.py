"""Per-step attention metadata of one KV cache group, built from vLLM's common metadata.

Each request row of a step is either a whole prompt (chunked prefill and prefix caching are off
while the plugin is active) or one decode token. Decode reads its context through a *slot table*:
the cache slot of every token it may attend to, in order. For a compacted request in a sparse
group that is the kept tokens at positions [0, budget) followed by the generated tokens at
[n, seq_len); the gap in between is never read, so its blocks can be freed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata

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
    # Decode tokens: [D] indices into the step, their slot tables [D, max_len] and lengths.
    decode_index: torch.Tensor
    decode_slot_table: torch.Tensor
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
        starts = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
        seq_lens = cm.seq_lens.cpu()[: cm.num_reqs].tolist()
        block_table = cm.block_table_tensor.cpu()
        slot_mapping = cm.slot_mapping[:num_tokens].cpu().long()
        store_slots = slot_mapping.clone()
        prefill_rows: list[tuple[int, int]] = []
        compress_bounds: list[tuple[int, int]] = []
        kept_slots: list[torch.Tensor] = []
        decode_tokens: list[int] = []
        decode_positions: list[torch.Tensor] = []
        decode_rows: list[int] = []
        packed = 0
        for row in range(cm.num_reqs):
            start, end = starts[row], starts[row + 1]
            num_new, seq_len = end - start, seq_lens[row]
            if num_new == 0:
                continue
            first_block = int(block_table[row, 0])
            if num_new == seq_len:
                self.prompt_len_by_first_block[first_block] = seq_len
                prefill_rows.append((start, end))
                if self.budget is not None and seq_len > self.budget:
                    compress_bounds.append((packed, packed + seq_len))
                    kept_slots.append(slot_mapping[start : start + self.budget])
                    store_slots[start:end] = -1
                packed += seq_len
            elif num_new == 1:
                decode_tokens.append(start)
                decode_rows.append(row)
                decode_positions.append(self._context_positions(first_block, seq_len))
            else:
                raise NotImplementedError(
                    "kvsparse: a step continued a partly computed prompt (chunked prefill, "
                    "prefix caching or speculative decoding); the plugin needs whole prompts"
                )
        prefill_index = torch.cat(
            [torch.arange(s, e) for s, e in prefill_rows] or [torch.empty(0, dtype=torch.long)]
        )
        lengths = torch.tensor([e - s for s, e in prefill_rows], dtype=torch.int32)
        cu_seqlens = torch.zeros(len(prefill_rows) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lengths, 0)
        slot_table, context_lens = self._slot_tables(block_table, decode_rows, decode_positions)
        device = self.device
        return KVSparseMetadata(
            num_actual_tokens=num_tokens,
            budget=self.budget,
            store_slots=store_slots.to(device),
            prefill_index=prefill_index.to(device),
            prefill_cu_seqlens=cu_seqlens.to(device),
            prefill_max_len=int(lengths.max()) if len(lengths) else 0,
            compress_bounds=compress_bounds,
            kept_slots=torch.cat(kept_slots or [torch.empty(0, dtype=torch.long)]).to(device),
            decode_index=torch.tensor(decode_tokens, dtype=torch.long).to(device),
            decode_slot_table=slot_table.to(device),
            decode_context_lens=context_lens.to(device),
            decode_max_len=int(context_lens.max()) if len(context_lens) else 0,
        )

    def _context_positions(self, first_block: int, seq_len: int) -> torch.Tensor:
        """Positions a decode token attends to in this group (its own included)."""
        if self.budget is None:
            return torch.arange(seq_len)
        prompt_len = self.prompt_len_by_first_block.get(first_block)
        if prompt_len is None:
            raise RuntimeError(
                "kvsparse: a decode step for a request whose prompt this worker never saw"
            )
        if prompt_len <= self.budget:
            return torch.arange(seq_len)
        return torch.cat([torch.arange(self.budget), torch.arange(prompt_len, seq_len)])

    def _slot_tables(
        self, block_table: torch.Tensor, rows: list[int], positions: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lens = torch.tensor([len(p) for p in positions], dtype=torch.int32)
        table = torch.zeros(len(rows), int(lens.max()) if rows else 0, dtype=torch.long)
        for i, (row, pos) in enumerate(zip(rows, positions, strict=True)):
            blocks = block_table[row, pos // self.block_size].long()
            table[i, : len(pos)] = blocks * self.block_size + pos % self.block_size
        return table, lens
