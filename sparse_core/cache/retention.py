"""What each KV group's cache holds of a sequence: tokens, blocks and bytes, on one rank.

Every group shares one pool of blocks (vLLM's hybrid KV cache, one page size for every group):
a block holds `layers_per_block` layers' K and V of `block_size` tokens, so the layer plan's
groups are cut into *KV groups* of at most that many layers, each with its own block table.
Whole and sparse layers then draw on the same memory, as a workload needs it: a prefix cache
holds a prompt's full KV in every layer while a running sequence holds its kept tokens, and no
start-up split between groups strands memory one of them needs (docs/architecture.md, "The KV
cache").

One `GroupRetention` per KV group (the way vLLM gives each KV cache group a spec) holds the
rule of a sequence's life in that group, which the block manager (allocation, the shrink after
prefill), the request checker (could it ever fit) and the model runner (which prompts a step
compresses) ask instead of deriving it:

- at admission the group holds the prefill whole while it runs in chunks (the last chunk scores
  every token), and only its kept tokens for a whole prefill (compressed as it is written); a
  sliding-window group holds its window and a step's chunk, a ring its chunks go round
  (`chunked_prefill_tokens`);
- after the prefill's last token it keeps LayerGroup.kept_tokens of them (min(n, budget), or a
  ratio-th of n for calibrated budgets; all n in a whole group), then one more for every token
  fed after it (generated or forced);
- with decode eviction a sparse group never holds more than its budget: the prefill keeps the
  budget less the decode window, and the tokens fed after it fill the rest (its *ring*), then
  each replaces the oldest of them (`decode_ring`);
- a sliding-window group holds the last `sliding_window` tokens: the prompt's most recent
  after prefill (written to blocks of its own, so that its ring never writes into a block
  another sequence reads), then each token fed replaces the oldest once the window is full;
- its peak is the larger of the two.

`KVRetention.build` makes them once, from the model, engine and sparsity configs and the model's
dtype; a new retention shape changes this file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.kernels.fp8 import FP8_DTYPE
from sparse_core.models.config import ModelConfig
from sparse_core.policy import LayerGroup, LayerPlan, plan_layers

# Most of a block's layers that may go unused: a KV group of fewer layers than a block holds
# leaves the rest of each of its blocks empty.
MAX_PADDED_LAYERS = 1 / 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layers_per_block(group_sizes: list[int]) -> int:
    """The most layers a block can hold, at most the smallest group's, with at most
    MAX_PADDED_LAYERS of every block's layer slots left empty (3 whole and 29 sparse layers: 3,
    in 11 KV groups; 10 and 22: 2, in 16)."""
    total = sum(group_sizes)
    for size in range(min(group_sizes), 1, -1):
        padded = sum(cdiv(n, size) * size for n in group_sizes)
        if padded - total <= total * MAX_PADDED_LAYERS:
            return size
    return 1


def split_plan(plan: LayerPlan, size: int) -> LayerPlan:
    """The plan with every group cut into groups of at most `size` layers (same name and
    budget), each a KV group with a block table of its own."""
    groups: list[LayerGroup] = []
    layer_to_group = list(plan.layer_to_group)
    for group in plan.groups:
        for start in range(0, len(group.layers), size):
            layers = group.layers[start : start + size]
            for layer in layers:
                layer_to_group[layer] = len(groups)
            groups.append(dataclasses.replace(group, layers=layers))
    return dataclasses.replace(plan, groups=tuple(groups), layer_to_group=tuple(layer_to_group))


class DecodeRing(NamedTuple):
    """The held token index the i-th token fed after a prefill goes to: first + (offset + i)
    % size, or first + i with size 0 (each one appended)."""

    first: int
    size: int
    offset: int = 0

    def grows(self, held: int) -> bool:
        """Whether a group holding `held` tokens takes one more for the next token fed, rather
        than replacing one in its full ring."""
        return self.size == 0 or held < self.first + self.size


@dataclass(frozen=True)
class GroupRetention:
    group: LayerGroup  # its name, layers and budget (None: whole)
    block_size: int  # tokens per block
    step_tokens: int = 0  # the most prompt tokens a step feeds (max_num_batched_tokens)

    def compresses(self, num_prefill_tokens: int) -> bool:
        """Whether the group writes a prefill of this length's kept tokens apart from the
        prefill: it keeps fewer than it feeds, or its window slides (a sliding group's ring
        then replaces tokens in its own blocks, never in cached ones)."""
        if self.group.sliding_window is not None:
            return True
        return self.tokens_after_prefill(num_prefill_tokens) < num_prefill_tokens

    def tokens_at_admission(self, num_prefill_tokens: int, chunked: bool = False) -> int:
        """Tokens held from a prefill's admission to its last token: those of its chunks when
        it runs in chunks, the kept ones when it runs whole."""
        n = num_prefill_tokens
        return self.chunked_prefill_tokens(n) if chunked else self.tokens_after_prefill(n)

    def chunked_prefill_tokens(self, num_prefill_tokens: int) -> int:
        """Tokens held while a prefill runs in chunks without caching: all of them (the last
        chunk scores every token), but in a sliding group the window before a chunk and the
        chunk, a ring the chunks go round (position p at held index p mod its size): the
        window's older tokens are overwritten as it slides."""
        window = self.group.sliding_window
        if window is None:
            return num_prefill_tokens
        return min(num_prefill_tokens, window - 1 + self.step_tokens)

    def tokens_after_prefill(self, num_prefill_tokens: int, num_later_tokens: int = 0) -> int:
        """Tokens held once a prefill of `num_prefill_tokens` is compressed and
        `num_later_tokens` more (generated, or prompt tokens forced one per step) are fed."""
        return self._held(num_prefill_tokens, num_later_tokens, num_prefill_tokens)

    def decode_ring(self, num_prefill_tokens: int) -> DecodeRing:
        """Where the tokens fed after a prefill of this length go (`DecodeRing`): after the
        kept prompt tokens, the oldest of them replaced once the bound is reached (decode
        eviction); or, in a sliding group, over every held token, the oldest replaced."""
        n = num_prefill_tokens
        kept, most = self.group.kept_tokens(n), self.group.max_tokens(n)
        if most is None:
            return DecodeRing(kept, 0)
        if self.group.sliding_window is not None:
            return DecodeRing(0, most, kept % most)
        return DecodeRing(kept, most - kept)

    def peak_tokens(
        self,
        num_prefill_tokens: int,
        num_later_tokens: int,
        chunked_prefill_tokens: int = 0,
        longest_prefill_tokens: int | None = None,
    ) -> int:
        """Most tokens a sequence ever holds: after its prefill and `num_later_tokens` more, or
        while a chunked prefill of `chunked_prefill_tokens` (0: none) runs. A preempted
        sequence prefills again, up to `longest_prefill_tokens`: more kept tokens then mean as
        many fewer fed after, but decode eviction's bound grows with a ratio budget, so the
        bound is the longest prefill's."""
        n = num_prefill_tokens
        after = self._held(n, num_later_tokens, max(n, longest_prefill_tokens or n))
        return max(after, self.chunked_prefill_tokens(chunked_prefill_tokens))

    def _held(self, num_prefill_tokens: int, num_later_tokens: int, bound_length: int) -> int:
        """The prefill's kept tokens and those fed after it, at most decode eviction's bound
        for a prefill of `bound_length` tokens."""
        held = self.group.kept_tokens(num_prefill_tokens) + num_later_tokens
        most = self.group.max_tokens(bound_length)
        return held if most is None else min(held, most)

    def caching_admission_blocks(self, num_prefill_tokens: int, num_cached_tokens: int) -> int:
        """New blocks a prefill that caches takes at admission: every prefill token's beyond
        the cached ones (a multiple of the block size), and a compressing group's kept tokens'
        in blocks of their own (BlockManager)."""
        n = num_prefill_tokens
        new = self.blocks(n) - num_cached_tokens // self.block_size
        if self.compresses(n):
            new += self.blocks(self.tokens_after_prefill(n))
        return new

    def blocks(self, num_tokens: int) -> int:
        """Blocks that hold this many tokens."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class KVRetention:
    """Every KV group's retention, and the cache's dtype and block shape, for one rank."""

    layer_plan: LayerPlan  # the sparsity config's layer groups
    plan: LayerPlan  # layer_plan cut into KV groups (`split_plan`), one per block table
    groups: tuple[GroupRetention, ...]  # one per KV group, as plan.groups
    kv_dtype: torch.dtype
    bytes_per_token_per_layer: int  # K and V of one token in one layer, on one rank
    layers_per_block: int

    @property
    def block_size(self) -> int:
        """Tokens per block, the same in every group."""
        return self.groups[0].block_size

    @property
    def block_bytes(self) -> int:
        """One block: K and V of `block_size` tokens in `layers_per_block` layers."""
        return self.bytes_per_token_per_layer * self.layers_per_block * self.block_size

    def num_blocks(self, kv_cache_bytes: int) -> int:
        """Blocks a KV cache of this many bytes holds; at least two a group."""
        blocks = kv_cache_bytes // self.block_bytes
        if blocks < 2 * len(self.groups):
            raise ValueError(
                f"KV cache of {kv_cache_bytes / 2**30:.3f} GiB is too small: it holds {blocks} "
                f"blocks of {self.block_size} tokens in {self.layers_per_block} layers, and "
                f"the {len(self.groups)} KV groups of layer groups "
                f"{sorted({g.group.name for g in self.groups})} need at least two each"
            )
        return blocks

    @classmethod
    def build(
        cls,
        model: ModelConfig,
        config: EngineConfig,
        sparsity: SparsityConfig,
        dtype: torch.dtype,
    ) -> KVRetention:
        """`config` with its block size filled in (EngineConfig.on_device); `dtype`: the
        model's, which the cache takes unless kv_cache_dtype is FP8. Under tensor parallelism a
        rank caches its share of the KV heads."""
        assert config.block_size is not None, "EngineConfig.on_device fills block_size"
        layer_plan = plan_layers(sparsity, model.num_hidden_layers, model.name, model.sliding)
        size = layers_per_block([len(g.layers) for g in layer_plan.groups])
        plan = split_plan(layer_plan, size)
        kv_dtype = FP8_DTYPE if config.fp8_kv_cache else dtype
        kv_heads = model.num_key_value_heads // config.tensor_parallel_size
        per_layer = 2 * kv_heads * model.head_dim * kv_dtype.itemsize
        step = config.max_num_batched_tokens
        assert step is not None, "EngineConfig fills max_num_batched_tokens"
        groups = tuple(GroupRetention(g, config.block_size, step) for g in plan.groups)
        return cls(layer_plan, plan, groups, kv_dtype, per_layer, size)
