"""The token agreement that sparse_core.bench.vllm_agreement reports (no vLLM needed)."""

from __future__ import annotations

import pytest

from sparse_core.bench.vllm_agreement import Agreement, main


def test_agreement_counts_identical_outputs_and_the_agreeing_prefix() -> None:
    a = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    b = [[1, 2, 3, 4], [5, 6, 0, 8], [9, 9, 9, 9]]
    agree = Agreement.of(a, b)
    assert (agree.identical, agree.prompts) == (1, 3)
    # 4/4, 2/4 (first difference at token 2), 2/4 (one output ends early).
    assert agree.prefix_share == pytest.approx((1 + 0.5 + 0.5) / 3)


def test_agreement_is_symmetric_and_needs_the_same_prompts() -> None:
    a, b = [[1, 2], [3]], [[1, 3], [3]]
    assert Agreement.of(a, b) == Agreement.of(b, a)
    with pytest.raises(ValueError, match="same prompts"):
        Agreement.of(a, b[:1])


def test_the_sparse_run_must_be_sparse() -> None:
    with pytest.raises(SystemExit):
        main(["--policy", "dense"])
