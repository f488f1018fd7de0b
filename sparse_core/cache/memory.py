"""Splitting KV memory between layer groups at start-up (docs/architecture.md, "The KV cache")."""

from __future__ import annotations

from sparse_core.cache.retention import KVRetention


def split_kv_memory(
    retention: KVRetention,
    total_bytes: int,
    expected_input_len: int,
    expected_output_len: int,
) -> list[int]:
    """Blocks per group, in proportion to the bytes a typical request holds in each group after
    its prefill and all its output.

    With this split every group fills up at the same number of typical sequences, so none strands
    memory the others need. Workloads unlike the typical one strand some; the engine reports
    per-group usage so that shows.
    """
    groups = retention.groups
    demand = [
        g.bytes_per_token * g.tokens_after_prefill(expected_input_len, expected_output_len)
        for g in groups
    ]
    total_demand = sum(demand)
    blocks = [
        int(total_bytes * d / total_demand) // g.block_bytes
        for g, d in zip(groups, demand, strict=True)
    ]
    if min(blocks) < 2:
        raise ValueError(
            f"KV cache of {total_bytes / 2**30:.3f} GiB is too small: it gives layer groups "
            f"{[g.group.name for g in groups]} {blocks} blocks of {retention.block_size} tokens"
        )
    return blocks
