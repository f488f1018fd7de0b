"""How the vLLM plugin reads a step's rows from vLLM's host metadata (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from sparse_core.vllm_plugin.step_rows import step_rows


def _rows(new_tokens: list[int], seq_lens: list[int]):
    starts = torch.tensor([0, *new_tokens]).cumsum(0)
    return step_rows(starts, torch.tensor(seq_lens))


def test_decodes_first_then_prompts_are_two_slices() -> None:
    # Three decode rows, a one-token prompt, two whole prompts, then a padded row.
    rows = _rows([1, 1, 1, 1, 5, 7, 0], [40, 9, 23, 1, 5, 7, 0])
    assert rows.decode_rows == slice(0, 3) and rows.decode_tokens == slice(0, 3)
    assert rows.prompt_rows == slice(3, 6) and rows.prompt_tokens == slice(3, 16)
    assert rows.prompt_bounds == [(3, 4), (4, 9), (9, 16)]
    assert rows.num_decodes == 3 and rows.num_prompts == 3


def test_interleaved_rows_are_indices() -> None:
    rows = _rows([4, 1, 3, 1], [4, 30, 3, 12])
    assert torch.equal(rows.decode_rows, torch.tensor([1, 3]))
    assert torch.equal(rows.decode_tokens, torch.tensor([4, 8]))
    assert torch.equal(rows.prompt_tokens, torch.tensor([0, 1, 2, 3, 5, 6, 7]))
    assert rows.prompt_bounds == [(0, 4), (5, 8)]


def test_a_step_of_decodes_only_has_no_prompt_tokens() -> None:
    rows = _rows([1, 1], [100, 7])
    assert rows.prompt_tokens == slice(0, 0) and rows.num_prompts == 0
    assert rows.decode_tokens == slice(0, 2)


def test_a_partly_computed_prompt_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="whole prompts"):
        _rows([1, 6], [20, 30])
