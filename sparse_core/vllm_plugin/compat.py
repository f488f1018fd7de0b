"""What differs between the vLLM releases the plugin supports, in one place.

vLLM 0.24 (the release built for torch 2.11) and 0.32-0.33 share every seam the plugin uses but
three:
- how an out-of-tree backend is named: 0.32 registers any name; 0.24 has a fixed set of names,
  of which `CUSTOM` is for third-party backends;
- how a backend lays out its KV cache: 0.32 asks `supported_kv_cache_layouts`; 0.24 asks for a
  logical shape (`get_kv_cache_shape`) and a physical order (`get_kv_cache_stride_order`);
- `SingleTypeKVCacheManager.remove_skipped_blocks` gets the prompt's length in 0.32, not in 0.24
  (the budget manager records it when the prompt's blocks are allocated), and 0.24's
  `find_longest_cache_hit` returns the blocks alone, without the hit's length.
"""

from __future__ import annotations

import vllm

from sparse_core.vllm_plugin.version import release

VLLM_RELEASE = release(vllm.__version__)
# 0.32 on: backends registered by any name, KV cache layouts, prompt lengths given to
# remove_skipped_blocks, cache hits with their length.
SEAMS_OF_0_32 = VLLM_RELEASE >= (0, 32)

# The name the backend registers under and reports from `get_name`.
BACKEND_NAME = "KVSPARSE" if SEAMS_OF_0_32 else "CUSTOM"


def register_backend(class_path: str) -> None:
    """The backend at `class_path` in vLLM's registry, under BACKEND_NAME."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as register

    register(BACKEND_NAME if SEAMS_OF_0_32 else AttentionBackendEnum.CUSTOM, class_path)


class TokenMajorKVCache:
    """Backend methods that make a layer's cache token-major: [blocks, block_size, kv_heads,
    K | V] in memory, viewed as [blocks, kv_heads, block_size, 2 * head_size] (the view
    `decode_tables.split_kv_cache` takes apart)."""

    if SEAMS_OF_0_32:

        @classmethod
        def supported_kv_cache_layouts(cls):
            from vllm.v1.kv_cache_interface import KVCacheLayout

            return (KVCacheLayout.LBNHC,)

    else:

        @staticmethod
        def get_kv_cache_shape(
            num_blocks: int,
            block_size: int,
            num_kv_heads: int,
            head_size: int,
            cache_dtype_str: str = "auto",
        ) -> tuple[int, ...]:
            return num_blocks, num_kv_heads, block_size, 2 * head_size

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple:
            # Memory order blocks, block_size, kv_heads, K|V (a leading layers dimension first).
            return (0, 1, 3, 2, 4) if include_num_layers_dimension else (0, 2, 1, 3)


def no_cache_hit(kv_cache_group_ids: list[int]) -> tuple:
    """`find_longest_cache_hit`'s answer for a group that caches nothing, in this release's
    form."""
    empty = tuple([] for _ in kv_cache_group_ids)
    return (empty, 0) if SEAMS_OF_0_32 else empty
