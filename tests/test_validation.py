"""Bad configuration and bad input fail fast, with a message that names the problem."""

from __future__ import annotations

import pytest
import torch

from sparse_core import LLM, EngineConfig, SamplingParams, SparsityConfig


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("dummy:tiny", max_model_len=256, kv_cache_memory_gb=0.001)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "snapkv", "budget": 32, "window": 32}, "budget .* must be greater than window"),
        ({"policy": "snapkv", "budget": 36, "window": 32, "sinks": 4}, "budget"),
        ({"policy": "h2o"}, "unknown sparsity policy 'h2o'"),
        ({"full_layers": [1, 2, 1]}, "duplicate"),
        ({"full_layers": -1}, "full_layers must be >= 0"),
        ({"full_layers": "first"}, "full_layers must be an int"),
        ({"pooling": "median"}, "unknown pooling"),
        ({"kernel_size": 4}, "kernel_size must be a positive odd number"),
    ],
)
def test_bad_sparsity_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparsityConfig(**kwargs)


@pytest.mark.parametrize(
    ("full_layers", "message"),
    [
        (5, "full_layers=5 exceeds the model's 4 layers"),
        ([0, 4], r"full_layers \[4\] out of range"),
    ],
)
def test_full_layers_beyond_the_model(full_layers, message):
    sparsity = SparsityConfig(policy="snapkv", budget=64, window=8, full_layers=full_layers)
    with pytest.raises(ValueError, match=message):
        LLM("dummy:tiny", sparsity=sparsity, kv_cache_memory_gb=0.001)


def test_auto_full_layers_without_a_profile():
    sparsity = SparsityConfig(policy="snapkv", budget=64, window=8, full_layers="auto")
    with pytest.raises(ValueError, match="calibrated profile for model 'dummy:tiny'"):
        LLM("dummy:tiny", sparsity=sparsity, kv_cache_memory_gb=0.001)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("no-such-model", "no-such-model"),
        ("dummy:gpt5", "gpt5"),
        ("/nonexistent/dir", "no such file or directory"),
    ],
)
def test_unknown_model(model, message):
    with pytest.raises(ValueError, match=message):
        LLM(model, kv_cache_memory_gb=0.001)


def test_bad_engine_config():
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match=r"max_model_len .* exceeds the model's"):
        LLM("dummy:tiny", max_model_len=100_000, kv_cache_memory_gb=0.001)


def test_block_size_defaults_by_device(tiny):
    """128-token pages on CUDA (the decode kernel's tile), 16 elsewhere; a given size stays."""
    assert EngineConfig().on_device("cuda", supports_fp8=True).block_size == 128
    assert EngineConfig().on_device("cpu", supports_fp8=False).block_size == 16
    assert EngineConfig(block_size=32).on_device("cuda", supports_fp8=True).block_size == 32
    expected = 128 if tiny.engine.runner.device.type == "cuda" else 16
    assert tiny.engine.config.block_size == tiny.engine.block_manager.block_size == expected


@pytest.mark.parametrize("supports_fp8", [True, False])
def test_fp8_if_supported_is_fp8_only_where_the_device_has_it(supports_fp8: bool):
    """The servers' default: FP8 weights and KV cache on FP8 tensor cores, none elsewhere;
    settings given stay as they are."""
    config = EngineConfig(quantization="fp8_if_supported", kv_cache_dtype="fp8_if_supported")
    device_type = "cuda" if supports_fp8 else "cpu"
    resolved = config.on_device(device_type, supports_fp8)
    expected = ("fp8", "fp8") if supports_fp8 else (None, "auto")
    assert (resolved.quantization, resolved.kv_cache_dtype) == expected
    given = EngineConfig(quantization=None, kv_cache_dtype="fp8").on_device("cuda", supports_fp8)
    assert (given.quantization, given.kv_cache_dtype) == (None, "fp8")


def test_a_server_engine_on_a_cpu_runs_without_fp8():
    """`kvsparse serve`'s default (fp8_if_supported) on a CPU: the model's dtype throughout."""
    llm = LLM(
        "dummy:tiny", device="cpu", quantization="fp8_if_supported",
        kv_cache_dtype="fp8_if_supported", kv_cache_memory_gb=0.01, max_model_len=256,
    )  # fmt: skip
    config = llm.engine.config
    assert (config.quantization, config.kv_cache_dtype) == (None, "auto")
    assert llm.engine.retention.kv_dtype == torch.float32


def test_prompt_longer_than_max_model_len(tiny):
    with pytest.raises(ValueError, match="max_model_len is 256"):
        tiny.generate([list(range(1, 300))])


def test_empty_prompt(tiny):
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny.generate([""])
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny.generate([[]])


def test_token_ids_outside_the_vocabulary(tiny):
    with pytest.raises(ValueError, match=r"integers in \[0, 512\)"):
        tiny.generate([[1, 2, 100_000]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": -3}, "max_tokens must be at least 1"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": float("inf")}, "top_p must be a finite number"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"stop": [""]}, "stop strings"),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop may hold at most 64 strings"),
        ({"stop": ["x" * 4097]}, "at most 4096 characters together"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be token ids \(>= 0\)"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids may hold at most 1024"),
        ({"stop_token_ids": [True]}, "stop_token_ids must be an integer"),
        ({"logit_bias": [1, 2]}, "logit_bias must map token ids to biases"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias keys must be token ids \(>= 0\)"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be an integer"),
        ({"logit_bias": {5: 100.5}}, r"logit_bias values must be in \[-100, 100\]"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values must be a finite number"),
        ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, "logit_bias may hold at most 1024"),
        ({"compress_prefix_len": 0}, "compress_prefix_len must be a positive integer"),
        ({"compress_prefix_len": True}, "compress_prefix_len must be a positive integer"),
        ({"compress_prefix_len": 2.5}, "compress_prefix_len must be a positive integer"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 2**63}, r"top_k must be at most the vocabulary size 512"),
        ({"top_k": 513}, r"top_k must be at most the vocabulary size 512"),
        ({"stop_token_ids": [10**12], "min_tokens": 2}, r"stop_token_ids must be in \[0, 512\)"),
        ({"stop_token_ids": [512]}, r"stop_token_ids must be in \[0, 512\)"),
        ({"logit_bias": {3: 1.0, 512: -5.0}}, r"logit_bias keys must be in \[0, 512\)"),
    ],
)
def test_fields_beyond_the_vocabulary_are_refused_when_the_request_is_added(tiny, kwargs, message):
    """Checked against the model before the request reaches a step: in a batched step they would
    fail every request of it (an int64 overflow, an index past the logits)."""
    with pytest.raises(ValueError, match=message):
        tiny.generate([[1, 2, 3]], SamplingParams(**kwargs))
    assert not tiny.engine.has_unfinished
    assert len(tiny.generate([[1, 2, 3]], SamplingParams(top_k=512, stop_token_ids=[511]))) == 1


def test_compress_prefix_longer_than_the_prompt(tiny):
    with pytest.raises(ValueError, match=r"compress_prefix_len \(4\) exceeds the prompt's 3"):
        tiny.generate([[1, 2, 3]], SamplingParams(compress_prefix_len=4))


def test_request_larger_than_the_whole_cache():
    llm = LLM("dummy:tiny", SparsityConfig(policy="dense"), max_model_len=4096,
              kv_cache_memory_gb=0.0003)  # fmt: skip
    with pytest.raises(ValueError, match=r"needs 251 KV blocks, and the cache has 19"):
        llm.generate([[i % 500 + 1 for i in range(4000)]])


def test_a_rejected_batch_runs_nothing(tiny):
    with pytest.raises(ValueError):
        tiny.generate([[1, 2, 3], []])
    assert not tiny.engine.has_unfinished
    tiny.engine.check_invariants()


def test_an_engine_shut_down_refuses_requests_clearly():
    """After shutdown (its GPU memory given back) a request is refused with a message, not a
    failure deep in the model; shutting down again is harmless."""
    with LLM("dummy:tiny", max_model_len=128, kv_cache_memory_gb=0.001) as llm:
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    with pytest.raises(RuntimeError, match="the engine was shut down"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    llm.shutdown()


def test_a_shut_down_engine_holds_no_tensor_of_its_model():
    """Shutdown moves every tensor of the model to the meta device, FP8 weight scales included
    (on a GPU that is the memory given back), and drops the KV cache."""
    with LLM("dummy:tiny", max_model_len=128, kv_cache_memory_gb=0.001, quantization="fp8") as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        model = llm.engine.runner.model
        assert any(name.endswith("weight_scale") for name, _ in model.named_buffers())
    held = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor.device.type != "meta"
    ]
    assert not held, held
    assert all(attn.k_cache.numel() == 0 for attn in model.attention_layers)
