"""Blocks of every KV group for every sequence: admission, growth, freeing, invariants."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from sparse_core.cache.block_pool import BlockHash, BlockPool, prefix_hashes
from sparse_core.cache.retention import KVRetention, cdiv
from sparse_core.sequence import Sequence


@dataclass(frozen=True)
class Admission:
    """How a waiting sequence would be admitted now (`BlockManager.admission`): what the
    scheduler reads to choose its first chunk, then hands to `BlockManager.allocate`. It holds
    while the pool does not change, i.e. within one scheduling decision; `allocate` refuses one
    made before the pool last changed (`BlockPool.version`)."""

    seq: Sequence
    chunked: bool  # its prefill runs in chunks
    cached: list[list[int]]  # per group: the cached blocks the prefill starts from
    num_cached_tokens: int  # the prefill tokens those hold, where the prefill starts
    new_blocks: int  # blocks it allocates, in every group together
    caches: bool  # whether the prefill caches (see BlockManager)
    fits: bool  # whether the pool has room for it now
    pool_version: int  # BlockPool.version it was made at


def _tail_first(tables: list[list[int]]) -> list[int]:
    """The blocks of several tables, the last of each first: a prefix cached in every group
    is then evicted from its tail in all of them before its head in any, so what stays is a
    prefix every group still has."""
    columns = itertools.zip_longest(*(table[::-1] for table in tables))
    return [block for column in columns for block in column if block is not None]


class BlockManager:
    """Owns the block pool the KV groups share, and a host-side mirror of every running
    sequence's block tables; how many tokens each group holds of a sequence, it asks the
    group's retention.

    The mirror (one int32 row per group and running sequence) changes only when a block is
    allocated, so a decode step gathers every group's block tables with one indexing op instead
    of converting Python lists for every sequence.

    With `enable_prefix_caching`, a prefill that has room for it *caches*: every group holds all
    of its tokens (the KV of every layer, as a chunked prefill does) and a compressing group
    writes the kept tokens to blocks of their own, so that at the prefill's end its full blocks
    stay in the pool as cached blocks (`BlockPool`) while each group keeps what it keeps. A
    later prefill whose first full blocks are cached in every group starts after them: whole
    groups share the cached blocks, and compressing groups read them when they score and gather
    the prompt, then keep their own selection. A prefill without room for that caches nothing
    and takes the blocks it takes without the cache; so does one that found nothing cached and
    would have to evict a live cached prefix to cache its own (`BlockPool`'s scan resistance).
    """

    def __init__(
        self,
        retention: KVRetention,
        num_blocks: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_prefix_caching: bool = False,
        min_uncached_tokens: int = 1,
    ) -> None:
        """min_uncached_tokens: the fewest tokens a prefill must compute after a cache hit (its
        last, which samples; a compressing policy's observation window, whose queries score the
        whole prompt)."""
        self.groups = retention.groups
        self.block_size = retention.block_size
        # Whether any group has a decode ring (decode eviction, sliding-window layers).
        self.rings = any(g.group.bounded for g in self.groups)
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.min_uncached_tokens = min_uncached_tokens
        width = cdiv(max_model_len, self.block_size)
        self.host_tables = torch.zeros((len(self.groups), max_num_seqs, width), dtype=torch.int32)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        # Prefill tokens asked for and found in the cache, over every admission (vLLM's prefix
        # cache queries and hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- admission ------------------------------------------------------------------------------

    def cached_blocks(self, seq: Sequence) -> list[list[int]]:
        """Per group, the cached blocks a prefill of `seq` would start from: the longest run of
        its first full blocks that every group has, leaving at least `min_uncached_tokens` to
        compute (empty lists when caching is off)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups]
        usable = max(seq.num_prefill_tokens - self.min_uncached_tokens, 0) // self.block_size
        hashes = self._block_hashes(seq, usable)
        found = [self.pool.cached_prefix(hashes, g) for g in range(len(self.groups))]
        common = min(map(len, found))
        return [blocks[:common] for blocks in found]

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The prefix hashes of the sequence's first `num_blocks` full blocks, each computed
        once in its life (`Sequence.block_hashes`)."""
        if len(seq.block_hashes) < num_blocks:
            bs = self.block_size
            prefix_hashes(seq.token_ids[: num_blocks * bs], bs, seq.block_hashes)
        return seq.block_hashes[:num_blocks]

    def _new_blocks(self, seq: Sequence, chunked: bool, num_cached: int | None) -> int:
        """The blocks an admission takes in every group together: caching (num_cached: tokens
        found in the cache) or not (None)."""
        n = seq.num_prefill_tokens
        if num_cached is None:
            return sum(g.blocks(g.tokens_at_admission(n, chunked)) for g in self.groups)
        return sum(g.caching_admission_blocks(n, num_cached) for g in self.groups)

    def admission(self, seq: Sequence, chunked: bool = False) -> Admission:
        """How `seq` would be admitted now: caching when caching is on and every group has room
        for it, else as without the cache (`Admission.fits` says whether even that fits)."""
        if self.enable_prefix_caching:
            cached = self.cached_blocks(seq)
            num_cached = len(cached[0]) * self.block_size
            new = self._new_blocks(seq, chunked, num_cached)
            if self._fits(cached, new, caches=True):
                return Admission(
                    seq, chunked, cached, num_cached, new, caches=True, fits=True,
                    pool_version=self.pool.version,
                )  # fmt: skip
        none: list[list[int]] = [[] for _ in self.groups]
        new = self._new_blocks(seq, chunked, None)
        fits = self._fits(none, new, caches=False)
        return Admission(
            seq, chunked, none, 0, new, caches=False, fits=fits, pool_version=self.pool.version
        )

    def _fits(self, cached: list[list[int]], new: int, caches: bool) -> bool:
        """Room for `new` blocks, beside the cached ones the admission takes out of the cache
        (they no longer count as free). A prefill that would cache without having found
        anything caches only into blocks that hold no live cached prefix (`BlockPool`): a new
        prefix does not displace the cached ones still asked for."""
        pool = self.pool
        if caches and not cached[0]:
            return pool.has_room_for_new_prefix(new)
        reused = sum(pool.refs(b) == 0 for blocks in cached for b in blocks)
        return new + reused <= pool.num_free

    def allocate(self, admission: Admission) -> int:
        """Blocks in every group for the prefill of the admitted sequence (an `admission` made
        since the pool last changed, that fits); returns the tokens found in the cache, where
        its prefill starts (`Sequence.start_prefill`)."""
        assert admission.fits, "allocating an admission that does not fit"
        assert admission.pool_version == self.pool.version, "allocating a stale admission"
        pool, seq, chunked = self.pool, admission.seq, admission.chunked
        pool.tick()
        seq.caches_prefill = admission.caches
        n = seq.num_prefill_tokens
        num_cached = admission.num_cached_tokens
        seq.table_row = self._free_rows.pop()
        # Every group's cached blocks taken before any allocates: none evicts another's.
        pool.take_cached([b for cached in admission.cached for b in cached])
        for g, group in enumerate(self.groups):
            cached = admission.cached[g]
            if admission.caches:
                # Every prefill token, the cached ones shared; the kept ones of a compressing
                # group in blocks of their own.
                table = cached + pool.allocate(group.blocks(n) - len(cached), g)
                if group.compresses(n):
                    kept = group.tokens_after_prefill(n)
                    seq.kept_tables[g] = pool.allocate(group.blocks(kept), g)
                seq.kv_lens[g] = n
            else:
                held = group.tokens_at_admission(n, chunked)
                table = pool.allocate(group.blocks(held), g)
                seq.kv_lens[g] = held
            seq.block_tables[g] = table
            self.host_tables[g][seq.table_row, : len(table)] = torch.tensor(table)
        self.prefix_cache_queries += n
        self.prefix_cache_hits += num_cached
        # Prompt tokens still to come (forced one per step) are kept whole, up to decode
        # eviction's bound.
        seq.prompt_kv_lens = [
            group.tokens_after_prefill(n, seq.num_forced_prompt_tokens) for group in self.groups
        ]
        seq.decode_rings = [group.decode_ring(n) for group in self.groups]
        return num_cached

    def clear_prefix_cache(self) -> None:
        """Forget every cached block (none may be in use) and the hit counts."""
        self.pool.clear_cache()
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    def end_prefill(self, seq: Sequence) -> None:
        """After a prefill's last token, every group keeps only the blocks of its kept tokens.
        A caching prefill's full blocks become findable in every group, and a compressing
        group's table becomes its kept blocks (the prefill's blocks stay in the cache). A
        chunked prefill that does not cache held every token, and its last chunk wrote each
        compressing group's kept tokens to the front of its blocks; a whole prefill holds no
        more already."""
        n = seq.prefill_len
        hashes = self._block_hashes(seq, n // self.block_size) if seq.caches_prefill else []
        released: list[list[int]] = []
        for g, group in enumerate(self.groups):
            kept = group.tokens_after_prefill(n)
            table = seq.block_tables[g]
            self.pool.register(table, hashes, g)
            kept_table = seq.kept_tables[g]
            if kept_table is not None:
                released.append(table)
                seq.block_tables[g] = table = kept_table
                seq.kept_tables[g] = None
                self.host_tables[g][seq.table_row, : len(table)] = torch.tensor(table)
            else:
                num_blocks = group.blocks(kept)
                released.append(table[num_blocks:])
                del table[num_blocks:]
            seq.kv_lens[g] = kept
        self.pool.free(_tail_first(released))
        seq.caches_prefill = False

    def can_append(self, seq: Sequence) -> bool:
        """Room for one more token in every group (a new block where the last one is full)."""
        return self.can_append_all([seq])

    def can_append_all(self, seqs: list[Sequence]) -> bool:
        """Room for one more token of every one of the sequences, in every group."""
        bs = self.block_size
        new = sum(
            held % bs == 0 and ring.grows(held)
            for seq in seqs
            for held, ring in zip(seq.kv_lens, seq.decode_rings, strict=True)
        )
        return new <= self.pool.num_free

    def append_slot(self, seq: Sequence) -> None:
        """Room for the token being decoded in every group: one more token held, in a new
        block where the last one is full, unless decode eviction holds the group at its bound
        (the token then replaces the oldest in its ring). Its slot: `batch_slots`."""
        bs, kv_lens = self.block_size, seq.kv_lens
        for g, (held, ring) in enumerate(zip(kv_lens, seq.decode_rings, strict=True)):
            if not ring.grows(held):
                continue
            if held % bs == 0:
                table = seq.block_tables[g]
                table += self.pool.allocate(1, g)
                self.host_tables[g, seq.table_row, len(table) - 1] = table[-1]
            kv_lens[g] = held + 1

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (those of a prefill that caches stay in the cache only
        once it has ended: a prefill cut short wrote no KV anyone can trust)."""
        # A cached prefix's tail is evicted before the head other prompts share.
        tables = zip(seq.block_tables, seq.kept_tables, strict=True)
        held = [blocks + (kept or []) for blocks, kept in tables]
        self.pool.free(_tail_first(held))
        self._free_rows.append(seq.table_row)
        seq.reset_cache_state()

    def batch_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """The sequences' block tables in every group: int32 [groups, B, most blocks], each
        padded."""
        rows = torch.tensor([seq.table_row for seq in seqs])
        width = max(max(map(len, seq.block_tables)) for seq in seqs)
        return self.host_tables[:, rows, :width]

    def batch_slots(
        self, seqs: list[Sequence], tables: torch.Tensor, kv_lens: torch.Tensor
    ) -> torch.Tensor:
        """The slots the sequences' decoded tokens go to in every group (int64 [groups, B]),
        from their `batch_tables` and the tokens each group holds (int [groups, B]): the last
        of them, or its place in the group's ring (`GroupRetention.decode_ring`)."""
        index = kv_lens.long() - 1
        if self.rings:
            rings = torch.tensor([seq.decode_rings for seq in seqs]).permute(2, 1, 0)
            first, size, offset = rings  # [G, B] each
            later = torch.tensor([seq.num_computed_tokens - seq.prefill_len for seq in seqs])
            index = torch.where(size > 0, first + (offset + later) % size.clamp(min=1), index)
        blocks = tables.gather(2, (index // self.block_size).unsqueeze(2)).squeeze(2)
        return blocks.long() * self.block_size + index % self.block_size

    def usage(self) -> dict[str, dict[str, int]]:
        """Per layer group (its KV groups together): the used and cached blocks it holds, and
        the pool's total and free blocks (cached ones count as free), shared by every group."""
        pool = self.pool
        usage: dict[str, dict[str, int]] = {}
        for g, group in enumerate(self.groups):
            blocks = usage.setdefault(
                group.group.name,
                {"total": pool.num_blocks, "used": 0, "free": pool.num_free, "cached": 0},
            )
            blocks["used"] += pool.num_used_by(g)
            blocks["cached"] += pool.num_cached_by(g)
        return usage

    def check_invariants(self, live: list[Sequence]) -> None:
        """The pool balanced, and each block is used by exactly as many live sequences as hold
        it (once each)."""
        pool = self.pool
        pool.check()
        owners: dict[int, int] = {}
        for g in range(len(self.groups)):
            for seq in live:
                blocks = seq.block_tables[g] + (seq.kept_tables[g] or [])
                assert len(blocks) == len(set(blocks)), f"group {g}: a sequence holds a block twice"
                for block in blocks:
                    owners[block] = owners.get(block, 0) + 1
        used = {b: pool.refs(b) for b in range(pool.num_blocks) if pool.refs(b)}
        assert owners == used, "used blocks and owners disagree"
