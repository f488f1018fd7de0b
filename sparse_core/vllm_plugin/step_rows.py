"""A vLLM step's requests by kind, read from host copies of its query starts and sequence
lengths, so that building a step's metadata never waits for the GPU. Plain torch, no vLLM
import, so it is tested without vLLM.

With chunked prefill and prefix caching off (the plugin turns both off), each request row of a
step is a whole prompt (as many new tokens as its sequence holds), one decode token, or nothing
(a padded row). vLLM puts decode rows first when a backend asks it to (the builder's
`reorder_batch_threshold`), so each kind's tokens are usually one contiguous range: then they
are addressed by a slice, which indexes a step's tensors without a gather or a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows or tokens of one kind: a slice when they are contiguous, else int64 indices on the host.
Index = slice | torch.Tensor


@dataclass
class StepRows:
    decode_rows: Index
    decode_tokens: Index
    prompt_rows: Index
    prompt_tokens: Index
    # Each prompt's [start, end) in the step's tokens (a prompt's tokens are its whole sequence).
    prompt_bounds: list[tuple[int, int]]

    @property
    def num_decodes(self) -> int:
        return index_len(self.decode_rows)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_bounds)


def index_len(index: Index) -> int:
    return index.stop - index.start if isinstance(index, slice) else len(index)


def step_rows(query_starts: torch.Tensor, seq_lens: torch.Tensor) -> StepRows:
    """Rows of a step from vLLM's query_start_loc [R + 1] and seq_lens [R], both on the host.

    Raises NotImplementedError for a row that continues a partly computed prompt (chunked
    prefill, prefix caching or speculative decoding), which compaction cannot handle.
    """
    starts = query_starts.tolist()
    lens = seq_lens.tolist()
    decode_rows: list[int] = []
    prompt_rows: list[int] = []
    prompt_bounds: list[tuple[int, int]] = []
    for row, seq_len in enumerate(lens):
        start, end = starts[row], starts[row + 1]
        new = end - start
        if new == 0:
            continue
        if new == seq_len:
            prompt_rows.append(row)
            prompt_bounds.append((start, end))
        elif new == 1:
            decode_rows.append(row)
        else:
            raise NotImplementedError(
                "kvsparse: a step continued a partly computed prompt (chunked prefill, "
                "prefix caching or speculative decoding); the plugin needs whole prompts"
            )
    return StepRows(
        decode_rows=_as_index([(r, r + 1) for r in decode_rows]),
        decode_tokens=_as_index([(starts[r], starts[r] + 1) for r in decode_rows]),
        prompt_rows=_as_index([(r, r + 1) for r in prompt_rows]),
        prompt_tokens=_as_index(prompt_bounds),
        prompt_bounds=prompt_bounds,
    )


def _as_index(ranges: list[tuple[int, int]]) -> Index:
    """Ranges in increasing order as one slice when each starts where the previous one ends,
    else as the indices they cover."""
    if not ranges:
        return slice(0, 0)
    if all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)):
        return slice(ranges[0][0], ranges[-1][1])
    return torch.cat([torch.arange(s, e) for s, e in ranges])
