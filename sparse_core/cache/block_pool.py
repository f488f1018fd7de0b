"""The pool of fixed-size KV blocks every KV group draws on, with its prefix cache.

A block belongs to one KV group while it is used or cached (a block id names the same memory
in every group: `KVRetention`). It is free, used (referenced by one or more sequences), or
cached: it holds the KV of a full block of prompt tokens in its group, known by the group and
the block's hash (`prefix_hashes`), and no sequence uses it. Cached
blocks count as free: allocation takes truly free blocks first, then evicts cached ones, so the
cache only ever holds memory that no sequence needs. A used block with a hash stays findable,
and sequences that share a prefix share its blocks.

Eviction resists a scan: a cached block that a prefill has found again (*proven*) leaves only
after every cached block that none has, each kind least recently used first; and a prefill that
found nothing caches its blocks only where nothing live is cached (`has_room_for_new_prefix`;
BlockManager decides): free blocks, and cached ones *expired*, idle for more than twice the
ticks (admissions, BlockManager's `tick`) that hits had found their blocks idle, on average.
Without that, more live prefixes than the cache holds (64 chats cycling through room for 28)
evict each other before they are asked for again and nothing ever hits; with it, the prefixes
cached first stay and hit at every turn while they are asked for, the others run as without
the cache, and a prefix no longer asked for (a finished conversation) makes room for new ones
once it expires.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict, deque

BlockHash = bytes
CacheKey = tuple[int, BlockHash]  # (KV group, prefix hash)
# Weight of each hit's idle ticks in their running average.
REUSE_EMA = 0.25


def prefix_hashes(token_ids: list[int], block_size: int, known: list[BlockHash]) -> None:
    """Extend `known`, the hashes of the first full blocks of `token_ids`, to every full block.
    Block i's hash covers its tokens and block i - 1's hash, so it names the whole prefix up to
    its end (the KV of a token depends on every token before it, and on nothing else)."""
    for i in range(len(known), len(token_ids) // block_size):
        digest = hashlib.blake2b(known[-1] if known else b"", digest_size=16)
        digest.update(array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        known.append(digest.digest())


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}  # used blocks: how many sequences hold each
        # Unused, hashed blocks, least recently used first: never found again, and found again.
        self._unproven: OrderedDict[int, None] = OrderedDict()
        self._proven: OrderedDict[int, None] = OrderedDict()
        self._key_of: dict[int, CacheKey] = {}
        self._block_of: dict[CacheKey, int] = {}
        self._group_of: dict[int, int] = {}  # used and cached blocks: their KV group
        self._used_per_group: dict[int, int] = {}
        self._cached_per_group: dict[int, int] = {}
        self._found: set[int] = set()  # hashed blocks a prefill has found (used or cached)
        # Expiry: the clock (admissions), when each cached block was last released, and the
        # average idle ticks of the cached blocks prefills found (None before the first).
        self._clock = 0
        self._idle_since: dict[int, int] = {}
        self._reuse_ticks: float | None = None
        # Bumped by every change: what was decided on the pool holds while it stays the same.
        self.version = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones."""
        return len(self._free) + len(self._unproven) + len(self._proven)

    def has_room_for_new_prefix(self, count: int) -> bool:
        """Whether a prefill that found nothing may cache `count` blocks: into free blocks and
        cached ones expired (`allocate` takes those first). Counts no further than it needs."""
        short = count - len(self._free)
        for cached in (self._unproven, self._proven):
            if short <= 0:
                break
            expired = itertools.takewhile(self._expired, cached)
            short -= sum(1 for _ in itertools.islice(expired, short))
        return short <= 0

    def tick(self) -> None:
        """One admission: the clock cached blocks age by."""
        self.version += 1
        self._clock += 1

    def _expired(self, block: int) -> bool:
        ttl = self._reuse_ticks
        return ttl is not None and self._clock - self._idle_since[block] > 2 * ttl

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def num_used_by(self, group: int) -> int:
        """Used blocks of one KV group."""
        return self._used_per_group.get(group, 0)

    def num_cached_by(self, group: int) -> int:
        """Cached blocks of one KV group."""
        return self._cached_per_group.get(group, 0)

    def _count(self, counts: dict[int, int], group: int, change: int) -> None:
        counts[group] = counts.get(group, 0) + change

    @property
    def num_cached(self) -> int:
        """Cached blocks no sequence uses (part of `num_free`)."""
        return len(self._unproven) + len(self._proven)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def allocate(self, count: int, group: int) -> list[int]:
        """`count` blocks for KV group `group`."""
        self.version += 1
        if count > self.num_free:
            raise RuntimeError(f"pool has {self.num_free} free blocks, {count} requested")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:  # a cached block leaves the cache: expired, then unproven, then proven
                block, _ = self._victim().popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                del self._idle_since[block]
                self._found.discard(block)
                self._count(self._cached_per_group, self._group_of[block], -1)
            self._refs[block] = 1
            self._group_of[block] = group
            blocks.append(block)
        self._count(self._used_per_group, group, count)
        return blocks

    def _victim(self) -> OrderedDict[int, None]:
        """The cached list whose least recently used block leaves next."""
        heads = [c for c in (self._unproven, self._proven) if c and self._expired(next(iter(c)))]
        if heads:
            return min(heads, key=lambda c: self._idle_since[next(iter(c))])
        return self._unproven or self._proven

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block no sequence holds goes back to the cache
        if it has a hash (as the most recently used), else to the free list."""
        self.version += 1
        for block in blocks:
            refs = self._refs.get(block)
            if refs is None:
                raise RuntimeError(f"block {block} freed but not in use")
            if refs > 1:
                self._refs[block] = refs - 1
                continue
            del self._refs[block]
            group = self._group_of[block]
            self._count(self._used_per_group, group, -1)
            if block in self._key_of:
                (self._proven if block in self._found else self._unproven)[block] = None
                self._idle_since[block] = self._clock
                self._count(self._cached_per_group, group, 1)
            else:
                del self._group_of[block]
                self._free.append(block)

    # -- the prefix cache ----------------------------------------------------------------------

    def cached_prefix(self, hashes: list[BlockHash], group: int) -> list[int]:
        """KV group `group`'s blocks holding the longest prefix of `hashes` that the pool has
        (changes nothing)."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get((group, block_hash))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take_cached(self, blocks: list[int]) -> None:
        """Reference blocks found by `cached_prefix` (a cached one becomes used again); each is
        proven from now on. A hit on cached blocks adds how long they were idle to the average
        (once per hit, however many blocks it found)."""
        self.version += 1
        idle: list[int] = []
        for block in blocks:
            self._found.add(block)
            if block in self._refs:
                self._refs[block] += 1
            else:
                (self._unproven if block in self._unproven else self._proven).pop(block)
                self._refs[block] = 1
                group = self._group_of[block]
                self._count(self._cached_per_group, group, -1)
                self._count(self._used_per_group, group, 1)
                idle.append(self._clock - self._idle_since.pop(block))
        if idle:
            mean, ttl = sum(idle) / len(idle), self._reuse_ticks
            self._reuse_ticks = mean if ttl is None else ttl + REUSE_EMA * (mean - ttl)

    def register(self, blocks: list[int], hashes: list[BlockHash], group: int) -> None:
        """Make KV group `group`'s used blocks findable by their prefix hashes (a hash the
        group has a block for already keeps that block; a block keeps its first hash)."""
        self.version += 1
        for block, block_hash in zip(blocks, hashes, strict=False):
            key = (group, block_hash)
            if key in self._block_of or block in self._key_of:
                continue
            self._key_of[block] = key
            self._block_of[key] = block

    def clear_cache(self) -> None:
        """Every cached block back to the free list, every hash forgotten (no block in use)."""
        self.version += 1
        assert not self._refs, "clearing the cache while blocks are in use"
        for cached in (self._unproven, self._proven):
            self._free.extend(cached)
            cached.clear()
        self._idle_since.clear()
        self._reuse_ticks = None
        self._key_of.clear()
        self._block_of.clear()
        self._found.clear()
        self._group_of.clear()
        self._cached_per_group.clear()

    def check(self) -> None:
        """Free, used and cached blocks partition the pool; the hash maps agree; every cached
        block has a hash."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        used, unproven, proven = set(self._refs), set(self._unproven), set(self._proven)
        assert not unproven & proven, "a cached block is both proven and not"
        cached = unproven | proven
        assert not free & used and not free & cached and not used & cached, "a block is twice"
        assert proven <= self._found and not unproven & self._found, "misfiled cached block"
        assert self._found <= set(self._key_of), "a found block without a hash"
        assert len(free) + len(used) + len(cached) == self.num_blocks, "blocks leaked"
        assert all(refs > 0 for refs in self._refs.values())
        assert cached <= set(self._key_of), "a cached block without a hash"
        assert set(self._idle_since) == cached, "idle times and cached blocks disagree"
        assert not free & set(self._key_of), "a free block with a hash"
        assert {self._block_of[k]: k for k in self._key_of.values()} == self._key_of
        assert set(self._group_of) == used | cached, "a used or cached block without a group"
        assert all(self._key_of[b][0] == self._group_of[b] for b in self._key_of), "key's group"
        for counts, blocks in ((self._used_per_group, used), (self._cached_per_group, cached)):
            actual: dict[int, int] = {}
            for block in blocks:
                self._count(actual, self._group_of[block], 1)
            assert {g: n for g, n in counts.items() if n} == actual, "per-group counts drift"
