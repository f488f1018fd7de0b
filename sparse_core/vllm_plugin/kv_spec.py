"""KV cache spec and manager of a sparse layer group: it keeps `budget` prompt tokens.

vLLM allocates a block for every prompt token before the prompt runs. The step that completes a
prompt compacts each sparse layer's kept tokens into the positions [0, budget) (the first
blocks); from the next scheduling step on, the manager frees the blocks that lie wholly inside
the prompt's gap [budget, n) and puts vLLM's null block in their place, the way its sliding-window
manager frees blocks that left the window. Generated tokens stay at their own positions (n, n+1,
...), so vLLM's slot mapping and allocation need no change.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec

from sparse_core.vllm_plugin.compat import no_cache_hit


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
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Tokens of each request's first allocation: its prompt (whole, as the plugin schedules
        # it), or after a preemption the prompt and output it recomputes. For vLLM releases
        # that do not pass the prompt length to remove_skipped_blocks.
        self._allocated_first: dict[str, int] = {}

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int, *args, **kwargs
    ):
        self._allocated_first.setdefault(request_id, num_tokens_main_model)
        return super().allocate_new_blocks(
            request_id, num_tokens, num_tokens_main_model, *args, **kwargs
        )

    def pop_blocks_for_free(self, request_id: str):
        self._allocated_first.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        if num_prompt_tokens is None:
            num_prompt_tokens = self._allocated_first.get(request_id)
        # Only after the step that completed the prompt has finished: that step compacted the
        # kept tokens into the first blocks.
        if num_prompt_tokens is None or processed_computed_tokens < num_prompt_tokens:
            return
        gap = gap_blocks(self.kv_cache_spec.budget, num_prompt_tokens, self.block_size)
        blocks = self.req_to_blocks.get(request_id, [])
        # Backwards, as vLLM frees: a block already null means the ones before it are too.
        freed = []
        for i in reversed(range(gap.start, min(gap.stop, len(blocks)))):
            if blocks[i] == self._null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        # Compacted blocks hold tokens chosen for one request: none is shared.
        return 0

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, *args, **kwargs):
        # No prefix caching for compacted groups (the plugin also turns it off).
        return no_cache_hit(kv_cache_group_ids)
