"""Pre-quantized FP8 checkpoints (compressed-tensors "FP8-Dynamic", what llm-compressor writes).

The checkpoint is made here from SmolLM2-135M with the compressed-tensors package itself: the
built-in model in bf16 (a Hugging Face directory), FP8-Dynamic applied to every Linear but
lm_head, weight scales from the package's min-max formula (what llm-compressor's observer
computes), compressed and saved the way llm-compressor saves. The engine must load its FP8
weights and scales as stored, choose like the load-time quantizer (`quantization="fp8"` from the
bf16 directory) on nearly every token, and refuse every other scheme by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.distributed import parallel_state as ps
from sparse_core.kernels import REFERENCE_OPS
from sparse_core.kernels.fp8 import FP8_DTYPE, quantize_rows
from sparse_core.models.config import DUMMY_PRESETS, ModelConfig
from sparse_core.models.dummy import dummy_weights
from sparse_core.models.llama import LlamaForCausalLM
from sparse_core.policy import plan_layers
from sparse_core.vllm_plugin.hf_export import export_hf_dir
from tests.hf_checkpoints import save_fp8_dynamic

pytest.importorskip("compressed_tensors", reason="the test extra's compressed-tensors")

MODEL = "smollm2-135m-instruct"
# Prompts with a fixed continuation: the greedy choice after each of its first POSITIONS
# prefixes is compared (teacher forcing: one early difference does not make every later one).
TEXTS = [
    ("The capital of France is", " Paris, a city on the Seine known for its museums"),
    ("Write a haiku about the sea.", " Waves fold into foam, the tide keeps its slow promise"),
    ("List three prime numbers:", " 2, 3 and 5 are the first three prime numbers"),
    ("def fibonacci(n):", "\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"),
    ("Explain why the sky is blue.", " Sunlight is scattered by the molecules of the air"),
    ("Translate 'good morning' to Spanish:", " Buenos días is how you say good morning"),
]
POSITIONS = 8
# Measured on CPU with compressed-tensors 0.20.1: 42 of 48 (87.5%). The two FP8 models are not
# the same numbers: the checkpoint's scales are bf16 (amax / 448 rounded), the load-time
# quantizer's float32, and 2.9% of the e4m3 codes differ by one step.
MIN_AGREEMENT = 0.75
ENGINE = {"max_model_len": 256, "max_num_batched_tokens": 1024}


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, dst / f.name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(the bf16 directory, its compressed-tensors FP8-Dynamic version)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fp8_checkpoint")
    exported = export_hf_dir(MODEL)  # the built-in GGUF, dequantized (cached)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    bf16, fp8 = root / "bf16", root / "fp8-dynamic"
    model.save_pretrained(bf16)
    save_fp8_dynamic(model, fp8)
    for d in (bf16, fp8):
        _copy_tokenizer(exported, d)
    return bf16, fp8


@pytest.fixture(scope="module")
def fp8_llm(checkpoints):
    with LLM(model=str(checkpoints[1]), **ENGINE) as llm:
        yield llm


def test_checkpoint_is_detected_and_reported(checkpoints, fp8_llm):
    saved = json.loads((checkpoints[1] / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "compressed-tensors" and saved["format"] == "float-quantized"
    quantization = fp8_llm.engine.model_config.checkpoint_quantization
    assert quantization.describe() == "compressed-tensors FP8-Dynamic"
    assert quantization.ignore == ("lm_head",)
    assert fp8_llm.engine.config.quantization == "fp8"  # taken from the checkpoint


def test_fp8_weights_and_scales_are_loaded_as_stored(checkpoints, fp8_llm):
    stored = load_file(checkpoints[1] / "model.safetensors")
    scale = stored["model.layers.0.self_attn.q_proj.weight_scale"]
    assert scale.shape == (576, 1) and scale.dtype == torch.bfloat16  # what the package writes
    model = fp8_llm.engine.runner.model
    fused = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.o_proj": ("self_attn.o_proj",),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.down_proj": ("mlp.down_proj",),
    }
    for i, layer in enumerate(model.model.layers):
        for ours, theirs in fused.items():
            linear = layer.get_submodule(ours)
            names = [f"model.layers.{i}.{t}" for t in theirs]
            weight = torch.cat([stored[f"{n}.weight"] for n in names])
            scales = torch.cat([stored[f"{n}.weight_scale"] for n in names])
            assert linear.weight.dtype == FP8_DTYPE and weight.dtype == FP8_DTYPE
            assert torch.equal(linear.weight.view(torch.uint8), weight.view(torch.uint8))
            assert linear.weight_scale.dtype == torch.float32
            assert torch.equal(linear.weight_scale, scales.float())
    assert model.lm_head.weight.dtype != FP8_DTYPE  # ignored by the checkpoint: unquantized


def test_greedy_tokens_agree_with_the_load_time_quantizer(checkpoints, fp8_llm):
    """The checkpoint's model and the load-time-quantized one (`quantization="fp8"` from the
    bf16 directory, which keeps working) choose the same greedy token after 42 of the 48
    prefixes (87.5%, CPU, compressed-tensors 0.20.1; asserted: 75%)."""
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def choices(llm: LLM) -> list[int]:
        encode = llm.tokenizer.encode
        prefixes = [
            encode(prompt) + encode(continuation)[:i]
            for prompt, continuation in TEXTS
            for i in range(POSITIONS)
        ]
        return [o.token_ids[0] for o in llm.generate(prefixes, one)]

    with LLM(model=str(checkpoints[0]), quantization="fp8", **ENGINE) as llm:
        assert llm.engine.model_config.checkpoint_quantization is None
        reference = choices(llm)
    chosen = choices(fp8_llm)
    agreement = sum(a == b for a, b in zip(chosen, reference, strict=True)) / len(reference)
    assert agreement >= MIN_AGREEMENT, (
        f"the FP8-Dynamic checkpoint chose the load-time-quantized model's token {agreement:.1%} "
        f"of {len(reference)} times"
    )


def _preset_config(preset: str, fmt: str) -> dict:
    """A quantization_config as compressed-tensors writes it, for one of its preset schemes."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(
        config_groups={preset: ["Linear"]},
        ignore=["lm_head"],
        format=fmt,
        quantization_status="compressed",
    )
    return {"quant_method": "compressed-tensors", **config.model_dump(exclude=["quant_method"])}


def _write_config(directory: Path, quantization_config: dict) -> None:
    """A config.json (the tiny dummy shape) declaring `quantization_config`, and no weights."""
    config = {"model_type": "llama", **vars(DUMMY_PRESETS["tiny"])}
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        (lambda: _preset_config("W4A16", "pack-quantized"), r"format 'pack-quantized'.*num_bits 4.*type 'int'.*strategy 'group'.*weight-only"),
        (lambda: _preset_config("W8A8", "int-quantized"), r"format 'int-quantized'.*weights: type 'int'.*input_activations: type 'int'"),
        (lambda: _preset_config("FP8", "float-quantized"), r"weights: strategy 'tensor'.*input_activations: strategy 'tensor'.*dynamic False"),
        (lambda: _preset_config("FP8_BLOCK", "float-quantized"), r"weights: strategy 'block'.*block_structure \[128, 128\].*input_activations: strategy 'group'"),
        (lambda: {"quant_method": "fp8", "weight_block_size": [128, 128]}, r"checkpoint quantization 'fp8' is not supported"),
        (lambda: {"quant_method": "gptq", "bits": 4}, r"checkpoint quantization 'gptq' is not supported"),
    ],
    ids=["int4-weight-only", "int8", "fp8-static-per-tensor", "fp8-block", "hf-fp8", "gptq"],
)  # fmt: skip
def test_other_schemes_are_refused_at_start_up_by_name(tmp_path, quantization_config, named):
    _write_config(tmp_path, quantization_config())  # refused before any weight is read
    with pytest.raises(ValueError, match=named):
        LLM(model=str(tmp_path), **ENGINE)


def test_kv_cache_scales_and_static_activations_are_refused():
    from sparse_core.models.prequantized import parse_quantization_config

    config = _preset_config("FP8_DYNAMIC", "float-quantized")
    assert parse_quantization_config(config, "ckpt").describe() == "compressed-tensors FP8-Dynamic"
    config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    config["config_groups"]["FP8_DYNAMIC"]["input_activations"]["dynamic"] = False
    with pytest.raises(ValueError, match=r"kv_cache_scheme.*input_activations: dynamic False"):
        parse_quantization_config(config, "ckpt")


def _fp8_checkpoint(config: ModelConfig) -> dict[str, torch.Tensor]:
    """A dummy model's weights with every projection as an FP8-Dynamic checkpoint stores it."""
    weights = dict(dummy_weights(config, 0, torch.device("cpu")))
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        weights[name], scale = quantize_rows(weights[name])
        weights[name.replace(".weight", ".weight_scale")] = scale.to(torch.bfloat16)
    return weights


def _rank(config: ModelConfig, weights, rank: int, size: int, monkeypatch) -> LlamaForCausalLM:
    monkeypatch.setattr(ps, "_STATE", ps.TensorParallelState(rank, size))
    plan = plan_layers(SparsityConfig(policy="dense"), config.num_hidden_layers, config.name)
    model = LlamaForCausalLM(config, plan, REFERENCE_OPS, 64)
    model.load_weights(weights)
    return model


def test_tensor_parallel_ranks_shard_the_scales_with_the_weights(monkeypatch):
    config = DUMMY_PRESETS["tiny"]  # 4 heads, 2 KV heads: 2 ranks
    weights = _fp8_checkpoint(config)
    ranks = [_rank(config, weights, r, 2, monkeypatch) for r in range(2)]
    d, attn = config.head_dim, "model.layers.1.self_attn"
    qkv = [m.model.layers[1].self_attn.qkv_proj for m in ranks]
    for i, (part, rows) in enumerate((("q", 2 * d), ("k", d), ("v", d))):
        for kind in ("weight", "weight_scale"):
            shards = [getattr(p, kind).split([2 * d, d, d])[i] for p in qkv]
            assert all(s.shape[0] == rows for s in shards)
            whole = torch.cat(shards).view(torch.uint8) if kind == "weight" else torch.cat(shards)
            full = weights[f"{attn}.{part}_proj.{kind}"]
            assert torch.equal(whole, full.view(torch.uint8) if kind == "weight" else full.float())
    for m in ranks:  # row-parallel: input columns split, every rank keeps every row's scale
        down = m.model.layers[0].mlp.down_proj
        assert torch.equal(
            down.weight_scale, weights["model.layers.0.mlp.down_proj.weight_scale"].float()
        )
    down_weights = [m.model.layers[0].mlp.down_proj.weight.view(torch.uint8) for m in ranks]
    full = weights["model.layers.0.mlp.down_proj.weight"].view(torch.uint8)
    assert torch.equal(torch.cat(down_weights, 1), full)


def test_a_fused_projection_half_quantized_is_refused(monkeypatch):
    config = DUMMY_PRESETS["tiny"]
    weights = _fp8_checkpoint(config)
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(
        config.num_key_value_heads * config.head_dim, config.hidden_size
    )
    del weights["model.layers.0.self_attn.k_proj.weight_scale"]
    with pytest.raises(ValueError, match=r"qkv_proj fuses projections .* partly in FP8"):
        _rank(config, weights, 0, 1, monkeypatch)


def test_the_server_takes_and_reports_the_checkpoint_quantization(tmp_path):
    """From config.json alone, before any engine loads: `kvsparse serve`, a Ray Serve config,
    and /v1/models."""
    from fastapi.testclient import TestClient

    from service.app import build_app
    from service.cli import build_parser
    from service.ray_app import RayAppConfig
    from service.serve import serving_configs
    from service.settings import PoolSpec, ServerSettings
    from sparse_core.models.prequantized import describe_checkpoint_quantization

    _write_config(tmp_path, _preset_config("FP8_DYNAMIC", "float-quantized"))
    engine, sparsity = serving_configs(
        build_parser().parse_args(["serve", "--model", str(tmp_path)])
    )
    assert engine.quantization == "fp8"
    assert RayAppConfig(model=str(tmp_path)).engine_config().quantization == "fp8"
    settings = ServerSettings(
        served_model_names=["m"],
        max_model_len=256,
        pools=[PoolSpec.of(sparsity)],
        quantization=engine.quantization,
        checkpoint_quantization=describe_checkpoint_quantization(engine.model),
    )
    card = TestClient(build_app(None, settings)).get("/v1/models").json()["data"][0]
    assert card["kvsparse"]["quantization"] == "fp8"
    assert card["kvsparse"]["checkpoint_quantization"] == "compressed-tensors FP8-Dynamic"
