"""What each layer group's KV cache holds of a sequence: tokens, blocks and bytes, on one rank.

One `GroupRetention` per layer group (the way vLLM gives each KV cache group a spec) holds the
rule of a sequence's life in that group, which the block manager (allocation, the shrink after
prefill), the request checker (could it ever fit), the memory split (blocks per group) and the
model runner (which prompts a step compresses) ask instead of deriving it:

- at admission the group holds the prefill whole while it runs in chunks (the last chunk scores
  every token), and only its kept tokens for a whole prefill (compressed as it is written);
- after the prefill's last token it keeps LayerGroup.kept_tokens of them (min(n, budget), or a
  ratio-th of n for calibrated budgets; all n in a whole group), then one more for every token
  fed after it (generated or forced);
- its peak is the larger of the two.

`KVRetention.build` makes them once, from the model, engine and sparsity configs and the model's
dtype; a new retention shape (decode-time eviction, say) changes this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.kernels.fp8 import FP8_DTYPE
from sparse_core.models.config import ModelConfig
from sparse_core.policy import LayerGroup, LayerPlan, plan_layers


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupRetention:
    group: LayerGroup  # its name, layers and budget (None: whole)
    block_size: int  # tokens per block
    bytes_per_token: int  # K and V of one token in every layer of the group, on one rank

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def compresses(self, num_prefill_tokens: int) -> bool:
        """Whether the group keeps fewer tokens than a prefill of this length feeds."""
        return self.tokens_after_prefill(num_prefill_tokens) < num_prefill_tokens

    def tokens_at_admission(self, num_prefill_tokens: int, chunked: bool = False) -> int:
        """Tokens held from a prefill's admission to its last token: all of them when it runs
        in chunks, the kept ones when it runs whole."""
        return num_prefill_tokens if chunked else self.tokens_after_prefill(num_prefill_tokens)

    def tokens_after_prefill(self, num_prefill_tokens: int, num_later_tokens: int = 0) -> int:
        """Tokens held once a prefill of `num_prefill_tokens` is compressed and
        `num_later_tokens` more (generated, or prompt tokens forced one per step) are fed."""
        return self.group.kept_tokens(num_prefill_tokens) + num_later_tokens

    def peak_tokens(
        self, num_prefill_tokens: int, num_later_tokens: int, chunked_prefill_tokens: int = 0
    ) -> int:
        """Most tokens a sequence ever holds: after its prefill and `num_later_tokens` more, or
        while a chunked prefill of `chunked_prefill_tokens` (0: none) holds all of them."""
        after = self.tokens_after_prefill(num_prefill_tokens, num_later_tokens)
        return max(after, chunked_prefill_tokens)

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
    """Every layer group's retention, and the cache's dtype, for one rank."""

    plan: LayerPlan
    groups: tuple[GroupRetention, ...]
    kv_dtype: torch.dtype
    bytes_per_token_per_layer: int  # K and V of one token in one layer, on one rank

    @property
    def block_size(self) -> int:
        """Tokens per block, the same in every group."""
        return self.groups[0].block_size

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
        plan = plan_layers(sparsity, model.num_hidden_layers, model.name)
        kv_dtype = FP8_DTYPE if config.fp8_kv_cache else dtype
        kv_heads = model.num_key_value_heads // config.tensor_parallel_size
        per_layer = 2 * kv_heads * model.head_dim * kv_dtype.itemsize
        groups = tuple(
            GroupRetention(g, config.block_size, len(g.layers) * per_layer) for g in plan.groups
        )
        return cls(plan, groups, kv_dtype, per_layer)
