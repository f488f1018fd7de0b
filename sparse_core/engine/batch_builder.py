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
    new_rows: list[int]
    cached_rows: list[int]
    cached_slots: list[list[int]]  # per group


@dataclass
class PrefillBatch:
    """Host-side description of a step's prefill part."""

    input_ids: list[int]
    positions: list[int]
    cu_seqlens: list[int]
    max_seqlen: int
    slot_mappings: list[list[int]]  # per group, per token; -1 where the group compresses
    # Per group, the prompts it compresses in this step: their bounds among the packed keys,
    # the tokens each keeps, where their window queries end, and where their kept tokens go.
    compress_bounds: list[list[tuple[int, int]]]
    compress_kept: list[list[int]]
    compress_query_ends: list[list[int]]
    compress_slots: list[list[int]]
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

    def build(self, step: ScheduledStep, block_manager: BlockManager) -> StepBatch:
        return StepBatch(
            self.prefill(step.prefills) if step.prefills else None,
            self.decode(step.decodes, block_manager) if step.decodes else None,
        )

    def _slots(self, table: list[int], count: int) -> list[int]:
        """The slots of the first `count` tokens held in a group's blocks, `table`: a range of
        slots per block (a prefill caching every token in each of a model's KV groups asks for
        tens of thousands)."""
        bs = self.retention.block_size
        slots: list[int] = []
        for block in table[: -(-count // bs)]:
            slots.extend(range(block * bs, block * bs + bs))
        del slots[count:]
        return slots

    def prefill(self, seqs: list[Sequence]) -> PrefillBatch:
        """Each sequence's scheduled tokens: a whole prefill (the prompt, plus outputs when
        recomputing after preemption; or only its compressed prefix when the request sets
        compress_prefix_len), or the next chunk of one.

        A group that keeps fewer tokens than the prefill compresses it when its last token is
        fed. A whole prefill's tokens then get slot -1 and a compression job instead: only the
        kept tokens ever reach that group's pool. A chunked prefill stores every token, and its
        last chunk's compression job writes the kept tokens over the front of its blocks. A
        prefill that caches stores every token too, its cached ones already there, and its
        compression jobs write the kept tokens to blocks of their own (BlockManager).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        cu_seqlens = [0]
        num_groups = len(self.retention.groups)
        slot_mappings: list[list[int]] = [[] for _ in range(num_groups)]
        compress_bounds: list[list[tuple[int, int]]] = [[] for _ in range(num_groups)]
        compress_kept: list[list[int]] = [[] for _ in range(num_groups)]
        compress_query_ends: list[list[int]] = [[] for _ in range(num_groups)]
        compress_slots: list[list[int]] = [[] for _ in range(num_groups)]
        cached = CachedChunks([0], [], [], [[] for _ in range(num_groups)])
        for seq in seqs:
            first, n = seq.num_computed_tokens, seq.prefill_len
            end = first + seq.num_scheduled_tokens
            input_ids += seq.token_ids[first:end]
            positions += range(first, end)
            cu_seqlens.append(len(input_ids))
            k_start = cached.cu_seqlens_k[-1]
            cached.cu_seqlens_k.append(k_start + end)
            cached.cached_rows += range(k_start, k_start + first)
            cached.new_rows += range(k_start + first, k_start + end)
            for g, group in enumerate(self.retention.groups):
                if seq.kv_lens[g] == n:  # the group's blocks hold every prefill token
                    slots = self._slots(seq.block_tables[g], end)
                    slot_mappings[g] += slots[first:]
                    cached.cached_slots[g] += slots[:first]
                else:
                    slot_mappings[g] += [-1] * (end - first)
                if end == n and group.compresses(n):
                    kept = group.tokens_after_prefill(n)
                    compress_bounds[g].append((k_start, k_start + n))
                    compress_kept[g].append(kept)
                    compress_query_ends[g].append(len(input_ids))
                    kept_table = seq.kept_tables[g] or seq.block_tables[g]
                    compress_slots[g] += self._slots(kept_table, kept)
        return PrefillBatch(
            input_ids,
            positions,
            cu_seqlens,
            max(seq.num_scheduled_tokens for seq in seqs),
            slot_mappings,
            compress_bounds,
            compress_kept,
            compress_query_ends,
            compress_slots,
            cached if cached.cached_rows else None,
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
            slots=block_manager.batch_slots(tables, context_lens),
            block_tables=tables,
            context_lens=context_lens.contiguous(),
        )
