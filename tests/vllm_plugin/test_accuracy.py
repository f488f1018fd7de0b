"""The accuracy suite's fast subset (tests/eval/test_accuracy.py) through stock vLLM + plugin.

Same samples and configurations as the native fast subset; each configuration's accuracy
through vLLM must be within one sample of the native engine's, and calibrated snapkv must
still beat uniform snapkv at the same effective compression.
"""

from __future__ import annotations

import pytest

import sparse_core.policy as policy
from sparse_core.eval.calibrate import comparison_configs
from sparse_core.eval.report import summarize
from sparse_core.eval.runner import RunSettings, run_suite
from sparse_core.eval.tasks import TaskBuilder
from tests.vllm_plugin.conftest import ENGINE_ARGS, MODEL

pytest.importorskip("vllm")
from sparse_core.vllm_plugin.accuracy import run_suite_vllm

TASKS = ("passkey", "niah_single_english", "niah_multikey")
LENGTH, SAMPLES = 500, 2
ONE_SAMPLE = 100 / (len(TASKS) * SAMPLES) + 0.1
ORDER_MARGIN = 33.0  # as in the native fast subset
CONFIGS = ("dense", "uniform@2x", "calibrated@2x")
NATIVE = RunSettings(model=MODEL, max_num_seqs=8, kv_cache_memory_gb=0.5, device="cpu")


@pytest.fixture(scope="module")
def samples(model_source):
    builder = TaskBuilder(model_source.tokenizer, seed=0)
    return [s for task in TASKS for s in builder.build(task, LENGTH, SAMPLES)]


@pytest.fixture(scope="module")
def configs():
    calibrated = policy.load_profile(MODEL)["full_layers"]
    return [c for c in comparison_configs(calibrated, [2.0]) if c.name in CONFIGS]


@pytest.fixture(scope="module")
def native(samples, configs) -> dict[str, float]:
    rows = summarize(run_suite(configs, samples, NATIVE, progress=False))
    return {row.config: row.overall for row in rows}


@pytest.fixture(scope="module")
def through_vllm(samples, configs) -> dict[str, float]:
    rows = summarize(run_suite_vllm(configs, samples, RunSettings(model=MODEL), ENGINE_ARGS))
    return {row.config: row.overall for row in rows}


@pytest.mark.parametrize("config", CONFIGS)
def test_vllm_accuracy_is_close_to_native(config, native, through_vllm):
    assert abs(through_vllm[config] - native[config]) <= ONE_SAMPLE, (native, through_vllm)


def test_calibrated_still_beats_uniform_through_vllm(native, through_vllm):
    print(f"accuracy native {native} through vLLM {through_vllm}")  # shown with pytest -s
    assert through_vllm["calibrated@2x"] >= through_vllm["uniform@2x"] + ORDER_MARGIN
