"""Blocks of every layer group for every sequence: admission, growth, freeing, invariants."""

from __future__ import annotations

import torch

from sparse_core.cache.block_pool import BlockPool
from sparse_core.cache.retention import KVRetention, cdiv
from sparse_core.engine.sequence import Sequence


class BlockManager:
    """Owns the pools, and a host-side mirror of every running sequence's block tables; how
    many tokens each group holds of a sequence, it asks the group's retention.

    The mirror (one int32 row per running sequence and group) changes only when a block is
    allocated, so a decode step gathers its block tables with one indexing op per group instead
    of converting Python lists for every sequence.
    """

    def __init__(
        self,
        retention: KVRetention,
        blocks_per_group: list[int],
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.groups = retention.groups
        self.block_size = retention.block_size
        self.pools = [BlockPool(n) for n in blocks_per_group]
        width = cdiv(max_model_len, self.block_size)
        self.host_tables = [
            torch.zeros((max_num_seqs, width), dtype=torch.int32) for _ in blocks_per_group
        ]
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def prefill_kv_lens(self, seq: Sequence, chunked: bool = False) -> list[int]:
        """Tokens each group holds after prefilling the sequence (prompt + any outputs, when it
        is recomputed after preemption; or the prompt's compressed prefix). While a chunked
        prefill runs, every group holds all of it: the last chunk scores every token."""
        n = seq.num_prefill_tokens
        return [group.tokens_at_admission(n, chunked) for group in self.groups]

    def can_allocate(self, seq: Sequence, chunked: bool = False) -> bool:
        lens = self.prefill_kv_lens(seq, chunked)
        return all(
            group.blocks(n) <= pool.num_free
            for group, pool, n in zip(self.groups, self.pools, lens, strict=True)
        )

    def allocate(self, seq: Sequence, chunked: bool = False) -> None:
        lens = self.prefill_kv_lens(seq, chunked)
        seq.table_row = self._free_rows.pop()
        seq.prefill_len = seq.num_prefill_tokens
        for g, (group, pool, n) in enumerate(zip(self.groups, self.pools, lens, strict=True)):
            blocks = pool.allocate(group.blocks(n))
            seq.block_tables[g] = blocks
            seq.kv_lens[g] = n
            self.host_tables[g][seq.table_row, : len(blocks)] = torch.tensor(blocks)
        # Prompt tokens still to come (forced one per step) are kept whole.
        seq.prompt_kv_lens = [
            group.tokens_after_prefill(seq.prefill_len, seq.num_forced_prompt_tokens)
            for group in self.groups
        ]

    def end_prefill(self, seq: Sequence) -> None:
        """After a prefill's last token, every group keeps only the blocks of its kept tokens.
        A chunked prefill held all of them, and its last chunk wrote each compressing group's
        kept tokens to the front of its blocks; a whole prefill holds no more already."""
        for g, (group, pool) in enumerate(zip(self.groups, self.pools, strict=True)):
            kept = group.tokens_after_prefill(seq.prefill_len)
            table = seq.block_tables[g]
            num_blocks = group.blocks(kept)
            pool.free(table[num_blocks:])
            del table[num_blocks:]
            seq.kv_lens[g] = kept

    def can_append(self, seq: Sequence) -> bool:
        """Room for one more token in every group (a new block where the last one is full)."""
        return all(
            kv_len % self.block_size or pool.num_free >= 1
            for pool, kv_len in zip(self.pools, seq.kv_lens, strict=True)
        )

    def can_append_all(self, seqs: list[Sequence]) -> bool:
        """Room for one more token of every one of the sequences, in every group."""
        return all(
            sum(seq.kv_lens[g] % self.block_size == 0 for seq in seqs) <= pool.num_free
            for g, pool in enumerate(self.pools)
        )

    def append_slots(self, seq: Sequence) -> list[int]:
        """Reserve the next slot in every group for the token being decoded; returns the slots."""
        slots = []
        for g, pool in enumerate(self.pools):
            pos = seq.kv_lens[g]
            table = seq.block_tables[g]
            if pos // self.block_size == len(table):
                table += pool.allocate(1)
                self.host_tables[g][seq.table_row, len(table) - 1] = table[-1]
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            seq.kv_lens[g] = pos + 1
        return slots

    def free(self, seq: Sequence) -> None:
        for pool, blocks in zip(self.pools, seq.block_tables, strict=True):
            pool.free(blocks)
        self._free_rows.append(seq.table_row)
        seq.reset_cache_state()

    def batch_tables(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Per group, the sequences' block tables as one padded int32 [B, max blocks] tensor."""
        rows = torch.tensor([seq.table_row for seq in seqs])
        return [
            table[rows, : max(len(seq.block_tables[g]) for seq in seqs)]
            for g, table in enumerate(self.host_tables)
        ]

    def usage(self) -> dict[str, dict[str, int]]:
        return {
            group.group.name: {
                "total": pool.num_blocks,
                "used": pool.num_used,
                "free": pool.num_free,
            }
            for group, pool in zip(self.groups, self.pools, strict=True)
        }

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every pool balanced, and its used blocks are exactly the live sequences' blocks,
        each owned once."""
        for g, pool in enumerate(self.pools):
            pool.check()
            owned = [b for seq in live for b in seq.block_tables[g]]
            assert len(owned) == len(set(owned)), f"group {g}: a block is owned twice"
            assert set(owned) == pool.used_blocks, f"group {g}: used blocks and owners disagree"
