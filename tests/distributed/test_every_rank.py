"""The operations every tensor-parallel rank runs (`@every_rank`): rank 0's ModelRunner sends each
to the workers as it runs it, workers run nothing else, and a collective outside one raises
instead of hanging. No second process: rank 0's side against a recording rank group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.distributed import all_gather, all_reduce
from sparse_core.distributed import parallel_state as ps
from sparse_core.distributed.every_rank import OPERATIONS, run_on_worker
from sparse_core.engine.model_runner import ModelRunner
from sparse_core.models.loader import load_model_source


class RecordingRanks:
    """A RankGroup that records what rank 0 sends."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def call(self, operation: str, *args: Any) -> None:
        self.calls.append((operation, args))


@pytest.fixture(scope="module")
def runner_and_ranks() -> tuple[ModelRunner, RecordingRanks]:
    config = EngineConfig(model="dummy:tiny", max_model_len=256, block_size=16, device="cpu")
    ranks = RecordingRanks()
    source = load_model_source(config.model)
    return ModelRunner(config, SparsityConfig(policy="dense"), source, ranks), ranks


def test_rank_0_sends_each_operation_to_the_workers_with_its_arguments(runner_and_ranks):
    runner, ranks = runner_and_ranks
    ranks.calls.clear()
    runner.allocate_kv_cache(4)
    runner.capture_decode_graphs()  # nothing to capture on CPU: still sent, every rank decides
    runner.release_kv_cache()
    assert ranks.calls == [
        ("allocate_kv_cache", (4,)),
        ("capture_decode_graphs", ()),
        ("release_kv_cache", ()),
    ]


def test_every_collective_issuing_runner_method_is_an_operation():
    assert {
        "allocate_kv_cache",
        "release_kv_cache",
        "execute",
        "profile_activation_bytes",
        "capture_prefill_graphs",
        "capture_decode_graphs",
    } <= set(OPERATIONS)


def test_a_worker_refuses_a_method_that_is_not_an_operation(runner_and_ranks):
    runner, _ = runner_and_ranks
    with pytest.raises(ValueError, match=r"'sample_tokens' is not an operation every rank runs"):
        run_on_worker(runner, "sample_tokens", ())


def test_a_collective_outside_an_operation_raises_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(ps, "_STATE", ps.TensorParallelState(0, 2))
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="outside an operation every rank runs"):
        all_reduce(x)
    with pytest.raises(RuntimeError, match="outside an operation every rank runs"):
        all_gather(x)


def test_one_rank_needs_no_operation():
    x = torch.ones(3)
    assert all_reduce(x) is x and all_gather(x) is x
