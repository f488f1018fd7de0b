"""The plugin's settings and version gate (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparse_core.config import SparsityConfig
from sparse_core.vllm_plugin.settings import ENV_VAR, parse_settings, settings_from_vllm_config
from sparse_core.vllm_plugin.version import check_vllm_version


class FakeVllmConfig:
    def __init__(self, additional_config: dict, num_layers: int | None = None) -> None:
        self.additional_config = additional_config
        self.model_config = None
        if num_layers is not None:  # the two fields of vLLM's ModelConfig the plan reads
            text_config = SimpleNamespace(num_hidden_layers=num_layers)
            self.model_config = SimpleNamespace(hf_text_config=text_config, model="/any/dir")


def test_no_settings_leave_the_plugin_off(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert settings_from_vllm_config(FakeVllmConfig({})) is None


@pytest.mark.parametrize(
    "raw",
    [{"policy": "dense"}, {"policy": "snapkv", "budget": 256, "full_layers": [0, 1, 2, 3]}],
)
def test_settings_that_compress_no_layer_leave_the_plugin_off(raw):
    """Dense, or every layer whole: vLLM keeps its own attention, so outputs are stock's."""
    assert settings_from_vllm_config(FakeVllmConfig({"kvsparse": raw}, num_layers=4)) is None
    sparse = {"policy": "snapkv", "budget": 256, "full_layers": [0, 1, 2]}
    assert settings_from_vllm_config(FakeVllmConfig({"kvsparse": sparse}, num_layers=4))


def test_additional_config_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, '{"policy": "streamingllm", "budget": 64}')
    config = FakeVllmConfig({"kvsparse": {"policy": "snapkv", "budget": 256, "full_layers": [0]}})
    settings = settings_from_vllm_config(config)
    assert settings.sparsity == SparsityConfig(policy="snapkv", budget=256, full_layers=[0])
    assert settings_from_vllm_config(FakeVllmConfig({})).sparsity.policy == "streamingllm"


def test_model_name_picks_the_calibrated_profile():
    settings = parse_settings({"policy": "snapkv", "full_layers": "auto", "model_name": "m"})
    assert settings.model_name == "m"
    plan = parse_settings(
        {"policy": "snapkv", "full_layers": "auto", "model_name": "smollm2-135m-instruct"}
    ).layer_plan(30, "/any/dir")
    assert plan.full_layers  # the profile's layers


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"policy": "snapkv", "budgett": 5}', "unknown sparsity option"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a dictionary"),
        ({"policy": "snapkv", "budget": 8, "window": 32}, "must be greater than window"),
        ({"policy": "snapkv", "decode_eviction": True}, "not supported by the vLLM plugin"),
    ],
)
def test_bad_settings_name_the_problem(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_settings(raw)


@pytest.mark.parametrize("version", ["0.24.0", "0.24.1", "0.32.0", "0.32.3", "0.33.1", "0.33.0rc1"])
def test_supported_vllm_versions(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.23.1", "0.25.0", "0.31.2", "0.34.0", "1.0.0"])
def test_other_vllm_versions_are_refused_clearly(version):
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.24 and 0\.32 to 0\.33.*" + version):
        check_vllm_version(version)


def test_a_memory_limit_in_gib_is_refused_before_vllm_starts():
    """vLLM's budget is a fraction of the GPU; the native engine's GiB cap is not silently
    dropped."""
    from service.vllm_engine import VllmAsyncLLM
    from sparse_core.config import EngineConfig

    config = EngineConfig(model="dummy:tiny", gpu_memory_limit_gb=24)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VllmAsyncLLM(config, SparsityConfig(policy="snapkv"))


def test_a_model_with_sliding_window_layers_is_refused_by_name():
    """Gemma 3's local layers keep their window; the plugin's plan would compress them."""
    transformers = pytest.importorskip("transformers")
    config = FakeVllmConfig({"kvsparse": {"policy": "snapkv", "budget": 256}}, num_layers=6)
    config.model_config.hf_text_config = transformers.Gemma3TextConfig(num_hidden_layers=6)
    with pytest.raises(ValueError, match=r"sliding-window layers \(Gemma 3\) are not supported"):
        settings_from_vllm_config(config)
