"""A step that fails because of one request fails that request only: the other requests of the
step finish with the tokens they get without it, and no KV block leaks. The failure is injected
into one row of the real sampler; the engine loop (`run_loop`) is the one servers run.

The other requests are recomputed (as after a preemption), so their tokens are compared on a
dense engine: with a compressing policy a recomputed prefill also scores the tokens generated
before it, and keeps other tokens."""

from __future__ import annotations

import pytest

from sparse_core import EngineConfig, SamplingParams, SparsityConfig
from sparse_core.engine import model_runner
from sparse_core.engine.engine_core import StepResult, run_loop
from sparse_core.engine.llm_engine import MAX_FAILED_STEPS, LLMEngine

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = {f"r{i}": [(i * 37 + j) % 500 + 1 for j in range(30 + 25 * i)] for i in range(4)}


CONFIG = EngineConfig(model="dummy:tiny", max_model_len=256, kv_cache_memory_gb=0.01, device="cpu")


@pytest.fixture(scope="module")
def engine():
    with LLMEngine(CONFIG, SparsityConfig(policy="dense")) as engine:
        yield engine


def run(engine: LLMEngine, params: dict[str, SamplingParams] | None = None) -> list[StepResult]:
    """Every prompt of PROMPTS through the engine loop until all have ended."""
    commands = [
        ("add", engine.make_sequence(rid, prompt, (params or {}).get(rid, PARAMS)))
        for rid, prompt in PROMPTS.items()
    ]
    results: list[StepResult] = []

    def receive(block: bool):
        if commands:
            return commands.pop(0)
        return ("stop", None) if block else None

    run_loop(engine, receive, results.append)
    engine.check_invariants()
    assert all(group["used"] == 0 for group in engine.block_manager.usage().values())
    return results


def finished(results: list[StepResult]) -> dict[str, list[int]]:
    return {o.request_id: o.token_ids for r in results for o in r.outputs if o.finished}


def errors(results: list[StepResult]) -> dict[str, str]:
    return dict(e for r in results for e in r.errors)


def failing_row(monkeypatch, fails) -> list[int]:
    """The sampler raises whenever `fails(seq)` holds for a row it samples; returns the list
    that counts its failures."""
    real, count = model_runner.sample, []

    def sample(logits, seqs, generator, wanted, next_ids=None):
        if any(w and fails(seq) for seq, w in zip(seqs, wanted, strict=True)):
            count.append(1)
            raise RuntimeError("injected failure of one row")
        return real(logits, seqs, generator, wanted, next_ids)

    monkeypatch.setattr(model_runner, "sample", sample)
    return count


@pytest.fixture(scope="module")
def alone_tokens(engine) -> dict[str, list[int]]:
    return finished(run(engine))


@pytest.mark.parametrize("after_tokens", [0, 5], ids=["at-its-first-token", "mid-decode"])
def test_one_requests_failure_fails_it_alone(engine, alone_tokens, monkeypatch, after_tokens):
    count = failing_row(
        monkeypatch, lambda s: s.request_id == "r2" and len(s.output_token_ids) >= after_tokens
    )
    results = run(engine)
    assert errors(results).keys() == {"r2"}
    assert "injected failure of one row" in errors(results)["r2"]
    tokens = finished(results)
    assert tokens == {rid: ids for rid, ids in alone_tokens.items() if rid != "r2"}
    assert len(count) == 2, "found in the step it failed in and the next, with it alone"


def test_a_failure_that_does_not_come_back_fails_nobody(engine, alone_tokens, monkeypatch):
    """A step that fails once (not because of a request): every request is recomputed and
    finishes as it would have."""
    failures = failing_row(monkeypatch, lambda s: not failures and len(s.output_token_ids) == 3)
    results = run(engine)
    assert failures == [1]
    assert not errors(results)
    assert finished(results) == alone_tokens


def test_a_request_that_always_fails_with_others_fails_after_a_bounded_number_of_steps(
    engine, monkeypatch
):
    """A failure that needs two requests in one step: each alone succeeds, together they fail;
    after at most MAX_FAILED_STEPS failed steps one of them fails, and the others finish."""
    both = {"r1", "r3"}

    def together(seq) -> bool:
        running = {s.request_id for s in engine.scheduler.running}
        return seq.request_id in both and both <= running

    count = failing_row(monkeypatch, together)
    results = run(engine)
    assert set(errors(results)) <= both and errors(results)
    assert set(finished(results)) == set(PROMPTS) - set(errors(results))
    assert len(count) <= MAX_FAILED_STEPS


def test_with_a_compressing_policy_the_others_finish_whole(monkeypatch):
    failing_row(monkeypatch, lambda s: s.request_id == "r1" and len(s.output_token_ids) >= 2)
    sparsity = SparsityConfig(policy="snapkv", budget=40, window=8, full_layers=1)
    with LLMEngine(CONFIG, sparsity) as engine:
        results = run(engine)
    assert errors(results).keys() == {"r1"}
    tokens = finished(results)
    assert set(tokens) == set(PROMPTS) - {"r1"}
    assert all(len(ids) == PARAMS.max_tokens for ids in tokens.values())
