"""Gemma 3 (text) in the native engine: a small random checkpoint saved by transformers, its
greedy tokens equal to transformers' own with prompts and generations longer than the sliding
window (the local layers' window then slides, in prefill, chunked prefill, prefix-cache hits and
decode), dense and with snapkv over the global layers; the local layers never hold more than
their window."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.kernels import REFERENCE_OPS
from sparse_core.models.config import DUMMY_PRESETS, ModelConfig
from sparse_core.models.dummy import dummy_weights
from sparse_core.models.llama import LlamaForCausalLM
from sparse_core.models.loader import load_model_source
from sparse_core.policy import SlidingLayers, plan_layers
from sparse_core.vllm_plugin.hf_export import hf_config
from tests.hf_checkpoints import random_model, save_checkpoint, save_fp8_dynamic

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
NEW_TOKENS = 24


def prompts() -> list[list[int]]:
    """Longer than the window, one by several blocks; one shorter than it."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (45, 19, 5)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny Gemma 3: two local layers for each global one, a window of 8, RoPE bases apart
    and linear scaling on the global layers, an attention scale that is not 1/sqrt(head_dim),
    norm weights away from 0 (Gemma stores 1 + weight), weights large enough for peaked
    attention: a missing window, norm, scale or RoPE base changes the tokens."""
    config = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=512,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=20,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3,
    )  # fmt: skip
    model = random_model(transformers.Gemma3ForCausalLM, config, norm_weights=(-0.5, 0.5))
    return save_checkpoint(model, tmp_path_factory.mktemp("gemma3")), model


def transformers_greedy(model: torch.nn.Module, prompt: list[int]) -> list[tuple[int, float]]:
    """Greedy tokens and their log-probabilities: a random model this small soon repeats a
    token, whose log-probability still tells every position's attention apart."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        step.log_softmax(-1)[0, t].item() for step, t in zip(out.logits, tokens, strict=True)
    ]
    return list(zip(tokens, logprobs, strict=True))


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[tuple[int, float]]]:
    return [transformers_greedy(checkpoint[1], p) for p in prompts()]


def assert_same(outputs, expected) -> None:
    for out, want in zip(outputs, expected, strict=True):
        assert out.token_ids == [t for t, _ in want]
        got = [lp.logprob for lp in out.logprobs]
        assert got == pytest.approx([lp for _, lp in want], abs=1e-4)


def test_the_checkpoint_loads_with_its_layer_types_and_norm_offsets(checkpoint):
    path, model = checkpoint
    src = load_model_source(str(path))
    c = src.config
    assert c.sliding == SlidingLayers(WINDOW, (0, 1, 3, 4))
    assert (c.rope_theta, c.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.attention_scale == 20**-0.5 and c.hidden_act == "gelu_pytorch_tanh"
    assert c.sandwich_norms and c.norm_weight_offset == 1.0 and c.embedding_scale == 8.0
    norm = "model.layers.1.pre_feedforward_layernorm.weight"
    assert torch.equal(src.weights[norm], model.state_dict()[norm])


def test_a_config_of_transformers_4_gives_the_same_model(checkpoint):
    """Checkpoints saved before transformers 5 give RoPE as rope_theta, rope_scaling and
    rope_local_base_freq, and the layer types by a pattern."""
    hf = json.loads((checkpoint[0] / "config.json").read_text())
    old = {k: v for k, v in hf.items() if k not in ("rope_parameters", "layer_types")}
    old |= {
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window_pattern": 3,
    }  # fmt: skip
    assert ModelConfig.from_hf_dict(old) == ModelConfig.from_hf_dict(hf)


def test_logit_softcapping_is_refused(checkpoint):
    hf = json.loads((checkpoint[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="final_logit_softcapping is set"):
        ModelConfig.from_hf_dict(hf | {"final_logit_softcapping": 30.0})


# snapkv's budget is above the prompts, so the global layers keep every token.
SNAPKV = SparsityConfig(policy="snapkv", budget=64, window=4, sinks=2, full_layers=1)
RUNS = {
    "dense": (SparsityConfig(policy="dense"), {}),
    "snapkv": (SNAPKV, {}),
    # Chunks of 8 tokens: each chunk's window reaches back into the chunks before it.
    "chunked": (SNAPKV, {"max_num_batched_tokens": 8, "enable_chunked_prefill": True}),
    "no-cache": (SparsityConfig(policy="dense"), {"enable_prefix_caching": False}),
    # Without the cache a chunked prefill's local layers hold a ring of the window and a chunk
    # (8 - 1 + 8 tokens of the 45-token prompt), which the chunks go round.
    "chunked-no-cache": (
        SNAPKV,
        {
            "max_num_batched_tokens": 8,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": False,
        },
    ),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_greedy_tokens_equal_transformers(checkpoint, expected, run):
    sparsity, engine_args = RUNS[run]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(model=str(checkpoint[0]), sparsity=sparsity, dtype="float32", max_model_len=256,
             kv_cache_memory_gb=0.05, **engine_args) as llm:  # fmt: skip
        first = llm.generate(prompts(), params)
        # Again: the prompts' full blocks now come from the prefix cache (where it is on),
        # whose local layers' windows reach back into the cached blocks.
        again = llm.generate(prompts(), params)
    assert_same(first, expected)
    assert_same(again, expected)
    caching = engine_args.get("enable_prefix_caching", True)
    assert (again[0].num_cached_tokens > 0) == caching
    # The window, never more, though 45 + 24 tokens were fed; the short prompt's 5 + 23.
    assert [out.kv_tokens_held[f"sliding{WINDOW}"] for out in first] == [WINDOW] * 3


def test_a_chunked_prefill_holds_the_window_and_a_chunk_in_the_local_layers(checkpoint):
    """What a chunked prefill that does not cache takes at admission: every token in the global
    layers, the window less one and a step's chunk in the local ones (the prefix cache needs
    every token in every layer)."""
    with LLM(model=str(checkpoint[0]), sparsity=SNAPKV, dtype="float32", max_model_len=256,
             kv_cache_memory_gb=0.05, max_num_batched_tokens=8, enable_chunked_prefill=True,
             enable_prefix_caching=False) as llm:  # fmt: skip
        manager = llm.engine.block_manager
        seq = llm.engine.make_sequence("r", prompts()[0], SamplingParams(max_tokens=4))
        manager.allocate(manager.admission(seq, chunked=True))
        held = {r.group.name: held for r, held in zip(manager.groups, seq.kv_lens, strict=True)}
        manager.free(seq)
    assert held == {"full": 45, "budget64": 45, f"sliding{WINDOW}": WINDOW - 1 + 8}


def test_the_local_layers_form_a_group_of_their_own_outside_the_sparsity_plan():
    sliding = SlidingLayers(1024, tuple(i for i in range(48) if (i + 1) % 6))
    plan = plan_layers(SparsityConfig(policy="snapkv", budget=512, full_layers=3), 48, "m", sliding)
    by_name = {g.name: g.layers for g in plan.groups}
    # full_layers counts the global layers: the first three of them are 5, 11 and 17.
    assert by_name["full"] == (5, 11, 17)
    assert by_name["budget512"] == (23, 29, 35, 41, 47)
    assert by_name["sliding1024"] == sliding.layers
    dense = plan_layers(SparsityConfig(policy="dense"), 48, "m", sliding)
    assert {g.name for g in dense.groups} == {"full", "sliding1024"}


def test_the_dummy_preset_has_gemma3_12bs_shape():
    c = DUMMY_PRESETS["gemma3-12b"]
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (48, 16, 8)
    assert c.head_dim == 256 and c.sliding is not None and len(c.sliding.layers) == 40


@pytest.mark.parametrize("preset", ["gemma3-12b", "qwen3-8b"])
def test_a_dummy_checkpoint_fills_every_weight_and_exports_for_vllm(preset):
    """The preset's architecture at a tiny size: its random checkpoint names every parameter
    the model has (norms at one as Gemma stores them), and the config exported for vLLM's
    peer runs reads back as the same model."""
    config = dataclasses.replace(
        DUMMY_PRESETS[preset], hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100,
    )  # fmt: skip
    plan = plan_layers(
        SparsityConfig(policy="dense"), config.num_hidden_layers, "m", config.sliding
    )
    model = LlamaForCausalLM(config, plan, REFERENCE_OPS, 64)
    model.load_weights(dummy_weights(config, seed=0, device=torch.device("cpu")))
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert ModelConfig.from_hf_dict(hf_config(config, "bfloat16"), config.name) == config


def test_the_text_model_of_a_multimodal_checkpoint_loads_and_matches_transformers(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration (model_type gemma3): its text
    model alone is served, the same tokens and log-probabilities as transformers' on text."""
    text = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=512,
        sliding_window=WINDOW, query_pre_attn_scalar=20, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
        boi_token_index=297, eoi_token_index=298,
    )  # fmt: skip
    torch.manual_seed(2)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    path = save_checkpoint(model, tmp_path / "gemma3-mm")
    assert json.loads((path / "config.json").read_text())["model_type"] == "gemma3"
    prompt = prompts()[0][:30]
    expected = transformers_greedy(model, prompt)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(model=str(path), sparsity=SparsityConfig(policy="dense"), dtype="float32",
             max_model_len=256, kv_cache_memory_gb=0.05) as llm:  # fmt: skip
        assert_same(llm.generate([prompt], params), [expected])


def test_an_fp8_dynamic_checkpoint_loads_as_stored(checkpoint, tmp_path):
    """Gemma 3 quantized by compressed-tensors (FP8-Dynamic, as llm-compressor writes it): its
    projections load as stored, its norms (offsets from one, unquantized) as Gemma's, and it
    generates as the model quantized at load from the unquantized checkpoint does."""
    pytest.importorskip("compressed_tensors", reason="the test extra's compressed-tensors")
    model = transformers.Gemma3ForCausalLM.from_pretrained(checkpoint[0], dtype=torch.bfloat16)
    path = save_fp8_dynamic(model, tmp_path / "fp8")
    for f in checkpoint[0].iterdir():
        if f.name.startswith("tokenizer"):
            (path / f.name).write_bytes(f.read_bytes())
    stored = load_model_source(str(path)).weights
    # Teacher-forced: the greedy choice after each prefix of a fixed continuation (24 of 24
    # agree on the CPU; asserted: 75%).
    prefixes = [p + list(range(10, 10 + i)) for p in prompts() for i in range(8)]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    choices = {}
    for name, model_path, args in (
        ("stored", path, {}),
        ("at-load", checkpoint[0], {"quantization": "fp8"}),
    ):
        with LLM(model=str(model_path), sparsity=SNAPKV, max_model_len=256,
                 kv_cache_memory_gb=0.05, **args) as llm:  # fmt: skip
            if name == "stored":
                qkv = llm.engine.runner.model.model.layers[1].self_attn.qkv_proj
                q = stored["model.layers.1.self_attn.q_proj.weight"]
                assert torch.equal(qkv.weight[: q.shape[0]].view(torch.uint8), q.view(torch.uint8))
            choices[name] = [out.token_ids[0] for out in llm.generate(prefixes, one)]
    agree = sum(a == b for a, b in zip(choices["stored"], choices["at-load"], strict=True))
    assert agree >= 0.75 * len(prefixes), f"{agree} of {len(prefixes)}"


def test_a_norm_weight_keeps_its_offset_from_one_in_a_bf16_model():
    """Gemma computes 1 + weight in float32: an offset under 2^-8 would round away in bf16."""
    config = DUMMY_PRESETS["gemma3-tiny"]
    plan = plan_layers(
        SparsityConfig(policy="dense"), config.num_hidden_layers, "m", config.sliding
    )
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config, plan, REFERENCE_OPS, 64)
    finally:
        torch.set_default_dtype(torch.float32)
    weights = dict(dummy_weights(config, seed=0, device=torch.device("cpu")))
    weights["model.norm.weight"] = torch.full((config.hidden_size,), 0.001, dtype=torch.bfloat16)
    model.load_weights(weights)
    assert model.model.norm.weight.dtype == torch.float32
    assert torch.allclose(model.model.norm.weight, torch.tensor(1.001), atol=1e-6)
    x = torch.randn(3, config.hidden_size, dtype=torch.bfloat16)
    out, _ = model.model.norm(x)
    assert out.dtype == torch.bfloat16
