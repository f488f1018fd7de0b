"""Splitting KV memory between layer groups at start-up (docs/architecture.md, "The KV cache")."""

from __future__ import annotations

from sparse_core.policy import LayerPlan


def split_kv_memory(
    plan: LayerPlan,
    total_bytes: int,
    bytes_per_token_per_layer: int,
    block_size: int,
    expected_input_len: int,
    expected_output_len: int,
) -> list[int]:
    """Blocks per group, in proportion to what a typical request needs in each group.

    With this split every group fills up at the same number of typical sequences, so none strands
    memory the others need. Workloads unlike the typical one strand some; the engine reports
    per-group usage so that shows.
    """
    demand = [
        len(g.layers) * (g.kept_tokens(expected_input_len) + expected_output_len)
        for g in plan.groups
    ]
    total_demand = sum(demand)
    blocks = []
    for group, d in zip(plan.groups, demand, strict=True):
        block_bytes = len(group.layers) * bytes_per_token_per_layer * block_size
        blocks.append(int(total_bytes * d / total_demand) // block_bytes)
    if min(blocks) < 2:
        raise ValueError(
            f"KV cache of {total_bytes / 2**30:.3f} GiB is too small: it gives layer groups "
            f"{[g.name for g in plan.groups]} {blocks} blocks of {block_size} tokens"
        )
    return blocks
