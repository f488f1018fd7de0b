"""Rank 0's part of preparing a step: the scheduled sequences into a StepBatch, the host-side
description of the step that every rank's ModelRunner.execute runs (rank 0 sends it to the
other ranks under tensor parallelism)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparse_core.engine.cuda_graphs import DecodeBatch
from sparse_core.engine.device_tokens import IN_FLIGHT

if TYPE_CHECKING:
    from sparse_core.cache.block_manager import BlockManager
    from sparse_core.cache.retention import KVRetention
    from sparse_core.engine.scheduler import ScheduledStep
    from sparse_core.sequence import Sequence


@dataclass
class CachedChunks:
    """Host side of a ChunkContext: the earlier chunks of the prompts a step continues."""

    cu_seqlens_k: list[int]  # each prompt's keys: its cached tokens, then the step's
    new_rows: torch.Tensor  # int64 [P]
    cached_rows: torch.Tensor  # int64 [C]
    cached_slots: torch.Tensor  # int64 [groups, C]


@dataclass
class PrefillBatch:
    """Host-side description of a step's prefill part."""

    input_ids: list[int]
    positions: list[int]
    cu_seqlens: list[int]
    max_seqlen: int
    slot_mappings: torch.Tensor  # int64 [groups, tokens]; -1 where the group compresses
    # Per group, the prompts it compresses in this step: their bounds among the packed keys,
    # the tokens each keeps, where their window queries end, and where their kept tokens go.
    compress_bounds: list[list[tuple[int, int]]]
    compress_kept: list[list[int]]
    compress_query_ends: list[list[int]]
    compress_slots: list[torch.Tensor]  # int64, per group
    cached: CachedChunks | None = None  # when the step continues chunked prompts


@dataclass
class StepBatch:
    """Host-side description of one step (what rank 0 sends to the other ranks)."""

    prefill: PrefillBatch | None
    decode: DecodeBatch | None


class BatchBuilder:
    """Slots, block tables and compression jobs of a step's sequences, per layer group."""

    def __init__(self, retention: KVRetention) -> None:
        self.retention = retention
        self._block_offsets = torch.arange(retention.block_size)

    def build(self, step: ScheduledStep, block_manager: BlockManager) -> StepBatch:
        return StepBatch(
            self.prefill(step.prefills) if step.prefills else None,
            self.decode(step.decodes, block_manager) if step.decodes else None,
        )

    def _slots(self, table: list[int], count: int) -> torch.Tensor:
        """The slots of the first `count` tokens held in a group's blocks, `table` (int64 [count]):
        tensors, not lists, as a step of prefills that cache asks for every token's slot in each
        of a model's KV groups, cached ones included (hundreds of thousands)."""
        bs = self.retention.block_size
        blocks = torch.tensor(table[: -(-count // bs)], dtype=torch.int64)
        return (blocks[:, None] * bs + self._block_offsets).flatten()[:count]

    def prefill(self, seqs: list[Sequence]) -> PrefillBatch:
        """Each sequence's scheduled tokens: a whole prefill (the prompt, plus outputs when
        recomputing after preemption; or only its compressed prefix when the request sets
        compress_prefix_len), or the next chunk of one.

        A group that keeps fewer tokens than the prefill compresses it when its last token is
        fed. A whole prefill's tokens then get slot -1 and a compression job instead: only the
        kept tokens ever reach that group's pool. A chunked prefill stores every token, and its
        last chunk's compression job writes the kept tokens over the front of its blocks. A
        prefill that caches stores every token too, its cached ones already there, and its
        compression jobs write the kept tokens to blocks of their own (BlockManager). A
        sliding-window group that holds fewer tokens than a chunked prefill feeds stores them
        in a ring (`GroupRetention.chunked_prefill_tokens`): token p at held index p mod its
        size, the earlier chunks read back from the same place (where the window has moved
        on, another token's keys, which the window masks).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        cu_seqlens = [0]
        num_groups = len(self.retention.groups)
        # Per group, each prompt's part (concatenated at the end).
        slot_mappings: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        cached_slots: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        compress_bounds: list[list[tuple[int, int]]] = [[] for _ in range(num_groups)]
        compress_kept: list[list[int]] = [[] for _ in range(num_groups)]
        compress_query_ends: list[list[int]] = [[] for _ in range(num_groups)]
        compress_slots: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        cu_seqlens_k = [0]
        new_rows: list[torch.Tensor] = []
        cached_rows: list[torch.Tensor] = []
        for seq in seqs:
            first, n = seq.num_computed_tokens, seq.prefill_len
            end = first + seq.num_scheduled_tokens
            input_ids += seq.token_ids[first:end]
            positions += range(first, end)
            cu_seqlens.append(len(input_ids))
            k_start = cu_seqlens_k[-1]
            cu_seqlens_k.append(k_start + end)
            cached_rows.append(torch.arange(k_start, k_start + first))
            new_rows.append(torch.arange(k_start + first, k_start + end))
            whole = first == 0 and end == n
            for g, group in enumerate(self.retention.groups):
                held = seq.kv_lens[g]
                if held == n:  # the group's blocks hold every prefill token
                    slots = self._slots(seq.block_tables[g], end)
                    slot_mappings[g].append(slots[first:])
                    cached_slots[g].append(slots[:first])
                elif not whole:  # a sliding group's ring
                    slots = self._slots(seq.block_tables[g], held)
                    slot_mappings[g].append(slots[torch.arange(first, end) % held])
                    cached_slots[g].append(slots[torch.arange(first) % held])
                else:
                    slot_mappings[g].append(torch.full((end - first,), -1))
                    cached_slots[g].append(torch.full((first,), -1))
                if end == n and group.compresses(n):
                    kept = group.tokens_after_prefill(n)
                    compress_bounds[g].append((k_start, k_start + n))
                    compress_kept[g].append(kept)
                    compress_query_ends[g].append(len(input_ids))
                    kept_table = seq.kept_tables[g] or seq.block_tables[g]
                    compress_slots[g].append(self._slots(kept_table, kept))
        cached = None
        if cu_seqlens_k != cu_seqlens:
            cached = CachedChunks(
                cu_seqlens_k,
                torch.cat(new_rows),
                torch.cat(cached_rows),
                torch.stack([torch.cat(parts) for parts in cached_slots]),
            )
        return PrefillBatch(
            input_ids,
            positions,
            cu_seqlens,
            max(seq.num_scheduled_tokens for seq in seqs),
            torch.stack([torch.cat(parts) for parts in slot_mappings]),
            compress_bounds,
            compress_kept,
            compress_query_ends,
            [_cat(parts) for parts in compress_slots],
            cached,
        )

    def decode(self, seqs: list[Sequence], block_manager: BlockManager) -> DecodeBatch:
        tables = block_manager.batch_tables(seqs)
        # Every group's tokens held, the one decoded now included: [groups, B].
        context_lens = torch.tensor([seq.kv_lens for seq in seqs], dtype=torch.int32).T
        return DecodeBatch(
            input_ids=torch.tensor(
                [IN_FLIGHT if seq.input_in_flight else seq.next_input_token_id for seq in seqs]
            ),
            table_rows=torch.tensor([seq.table_row for seq in seqs]),
            positions=[seq.num_computed_tokens for seq in seqs],
            slots=block_manager.batch_slots(seqs, tables, context_lens),
            block_tables=tables,
            context_lens=context_lens.contiguous(),
        )


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
