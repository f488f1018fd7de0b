"""KV cache spec and manager of a sparse layer group: it keeps `budget` prompt tokens.

vLLM allocates a block for every prompt token before the prompt runs. The step that completes a
prompt compacts each sparse layer's kept tokens into the positions [0, budget) (the first
blocks); from the next scheduling step on, the manager frees the blocks that lie wholly inside
the prompt's gap [budget, n) and puts vLLM's null block in their place, the way its sliding-window
manager frees blocks that left the window. Generated tokens stay at their own positions (n, n+1,
...), so vLLM's slot mapping and allocation need no change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec


@dataclass(frozen=True, kw_only=True)
class BudgetAttentionSpec(AttentionSpec):
    budget: int

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # Prompts are allocated whole before they are compressed: the peak is a full request.
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes

    @property
    def prefix_cacheable(self) -> bool:
        # A compacted block holds tokens chosen for one prompt: it can never be shared.
        return False


def gap_blocks(budget: int, num_prompt_tokens: int, block_size: int) -> range:
    """Blocks that hold only dropped prompt tokens once a prompt of this length is compacted."""
    if num_prompt_tokens <= budget:
        return range(0)
    return range(cdiv(budget, block_size), num_prompt_tokens // block_size)


class BudgetAttentionManager(SingleTypeKVCacheManager):
    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        # Only after the step that completed the prompt has finished: that step compacted the
        # kept tokens into the first blocks.
        if num_prompt_tokens is None or processed_computed_tokens < num_prompt_tokens:
            return
        gap = gap_blocks(self.kv_cache_spec.budget, num_prompt_tokens, self.block_size)
        if gap:
            self._remove_blocks_in_range(request_id, gap.start, gap.stop)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool,
        kv_cache_spec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list, ...], int]:
        # No prefix caching for compacted groups (the plugin also turns it off).
        empty: Sequence[list] = [[] for _ in kv_cache_group_ids]
        return tuple(empty), 0
