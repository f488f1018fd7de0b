"""A pool of fixed-size KV blocks for one layer group."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def used_blocks(self) -> frozenset[int]:
        return frozenset(self._used)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"pool has {len(self._free)} free blocks, {count} requested")
        blocks = [self._free.popleft() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._used:
                raise RuntimeError(f"block {block} freed but not in use")
            self._used.remove(block)
            self._free.append(block)

    def check(self) -> None:
        """free + used == total and no block is both free and used (or free twice)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & self._used, "a block is both free and used"
        assert len(free) + len(self._used) == self.num_blocks, "blocks leaked"
