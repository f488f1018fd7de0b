"""FP8 weights (`quantization="fp8"`): the float32 reference against float64, the GPU matmul
against the reference, and the engine on the built-in model against its unquantized self."""

from __future__ import annotations

import pytest
import torch

from sparse_core import LLM, EngineConfig, SamplingParams
from sparse_core.config import SparsityConfig
from sparse_core.distributed.layers import (
    ColumnParallelLinear,
    QuantizableLinear,
    RowParallelLinear,
    quantize_at_load,
)
from sparse_core.kernels import REFERENCE_OPS
from sparse_core.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8Rows,
    fp8_linear_reference,
    quantize_rows,
    supports_fp8,
)
from sparse_core.models.config import DUMMY_PRESETS
from sparse_core.models.dummy import dummy_weights
from sparse_core.models.llama import LlamaForCausalLM
from sparse_core.policy import plan_layers


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_rows_are_scaled_to_the_e4m3_range_and_zero_rows_stay_finite():
    x = torch.randn(6, 64) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[2] = 0
    x_fp8, scale = quantize_rows(x)
    assert x_fp8.dtype == FP8_DTYPE and scale.shape == (6, 1)
    top = x_fp8.float().abs().amax(dim=1)
    assert torch.equal(top[[0, 1, 3, 4, 5]], torch.full((5,), FP8_MAX))
    assert torch.isfinite(x_fp8.float() * scale).all() and (x_fp8.float()[2] == 0).all()
    assert rel_err(x_fp8.float() * scale, x) < 0.05  # 3 mantissa bits: ~2^-4 per element


def test_reference_is_the_dequantized_product_and_close_to_the_exact_one():
    x, w = torch.randn(5, 3, 128), torch.randn(96, 128)
    w_fp8, w_scale = quantize_rows(w)
    y = fp8_linear_reference(x, w_fp8, w_scale)
    assert y.shape == (5, 3, 96)
    x_fp8, x_scale = quantize_rows(x.reshape(-1, 128))
    exact_dequantized = (x_fp8.double() * x_scale.double()) @ (w_fp8.double() * w_scale).t()
    assert rel_err(y.reshape(-1, 96), exact_dequantized) < 1e-5
    assert rel_err(y, x @ w.t()) < 0.06


@pytest.mark.parametrize("tp_layer", ["column", "row"])
def test_quantized_layers_compute_the_reference(tp_layer):
    """Built under quantize_at_load, a layer quantizes each full checkpoint tensor as it loads
    (each fused part's rows on their own): it computes the FP8 reference, close to the
    unquantized layer."""
    torch.manual_seed(0)
    if tp_layer == "column":
        plain = ColumnParallelLinear(64, [32, 16], bias=True)
        with quantize_at_load():
            layer = ColumnParallelLinear(64, [32, 16], bias=True)
        parts = plain.weight.data.split([32, 16])
    else:
        plain = RowParallelLinear(64, 48, bias=False)
        with quantize_at_load():
            layer = RowParallelLinear(64, 48, bias=False)
        parts = [plain.weight.data]
    assert layer.weight.dtype == FP8_DTYPE and not plain.quantizes_at_load
    with torch.no_grad():
        for index, part in enumerate(parts):
            layer.load_full(layer.weight, part, index, "weight")
        if plain.bias is not None:
            layer.bias.copy_(plain.bias)
    x = torch.randn(7, 64)
    with torch.no_grad():
        before = plain(x)
        after = layer(x)
    weight_fp8, scale = quantize_rows(plain.weight.data)
    assert torch.equal(layer.weight.float(), weight_fp8.float())
    assert torch.equal(layer.weight_scale, scale)
    bias = 0 if layer.bias is None else layer.bias
    expected = fp8_linear_reference(x, layer.weight, layer.weight_scale) + bias
    assert torch.allclose(after, expected)
    assert rel_err(after, before) < 0.06
    if tp_layer == "row":  # the MLP's down projection writes into rows of a larger tensor
        out = torch.full((9, 48), float("nan"))
        layer(x, out=out[1:8])
        assert torch.allclose(out[1:8], after) and out[[0, 8]].isnan().all()


def test_a_model_built_to_quantize_at_load_never_holds_its_projections_unquantized():
    """What keeps a 12B model's load under a 24 GB card: built under quantize_at_load, its
    projections take one byte a weight before anything loads (the embeddings, LM head and
    norms stay in the model's dtype), and stay so as the checkpoint loads."""
    config = DUMMY_PRESETS["tiny"]
    plan = plan_layers(SparsityConfig(policy="dense"), config.num_hidden_layers, config.name)
    with torch.device("cpu"), quantize_at_load():
        model = LlamaForCausalLM(config, plan, REFERENCE_OPS, 64)
    projections = [m for m in model.modules() if isinstance(m, QuantizableLinear)]
    assert projections and all(m.weight.dtype == FP8_DTYPE for m in projections)
    before = {name: p.dtype for name, p in model.named_parameters()}
    model.load_weights(dummy_weights(config, seed=0, device=torch.device("cpu")))
    assert {name: p.dtype for name, p in model.named_parameters()} == before


def test_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown quantization 'int4'.*'fp8'"):
        EngineConfig(quantization="int4")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not supports_fp8(torch.device("cuda")),
    reason="needs a GPU with FP8 tensor cores",
)
@pytest.mark.parametrize("rows", [1, 20, 256, 257, 4096])
def test_scaled_mm_matches_the_reference(rows):
    from sparse_core.kernels.triton_fp8 import fp8_linear_cuda

    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    w_fp8, w_scale = quantize_rows(torch.randn(1536, 4096, device="cuda", dtype=torch.bfloat16))
    expected = fp8_linear_reference(x.float(), w_fp8, w_scale)
    out = torch.full((rows + 2, 1536), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = fp8_linear_cuda(x, w_fp8, w_scale, out=out[1:-1])
    assert rel_err(y, expected) < 1e-2  # bf16 output
    assert not out[1:-1].isnan().any() and out[[0, -1]].isnan().all()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not supports_fp8(torch.device("cuda")),
    reason="needs a GPU with FP8 tensor cores",
)
@pytest.mark.parametrize("preset", ["tiny", "gemma3-tiny"])
@pytest.mark.parametrize("rows", [5, 100, 600, 2100])
def test_fp8_layers_take_activations_quantized_by_the_fused_kernels(preset, rows):
    """A decoder layer around its attention with FP8 projections, through the Triton kernels
    (the norms and the MLP's activation quantize for the projections they feed; every route of
    the FP8 matmul by row count; 2,100 rows cut into MLP slices) against plain torch, Llama's
    layout and Gemma's sandwich norms with GELU."""
    from sparse_core.kernels import get_ops

    cuda = torch.device("cuda")
    config = DUMMY_PRESETS[preset]
    plan = plan_layers(SparsityConfig(policy="dense"), config.num_hidden_layers, config.name)
    layers = []
    for ops in (get_ops(cuda), REFERENCE_OPS):
        torch.set_default_dtype(torch.bfloat16)
        try:
            with cuda, quantize_at_load():
                model = LlamaForCausalLM(config, plan, ops, 64)
        finally:
            torch.set_default_dtype(torch.float32)
        model.load_weights(dummy_weights(config, seed=0, device=cuda))
        layers.append(model.model.layers[0])
    generator = torch.Generator(cuda).manual_seed(0)
    hidden, q_size = config.hidden_size, config.num_attention_heads * config.head_dim
    x, residual = (
        torch.randn(rows, hidden, device=cuda, generator=generator).bfloat16() for _ in "xr"
    )
    attn_out = torch.randn(rows, q_size, device=cuda, generator=generator).bfloat16()
    (qkv, res), (want_qkv, want_res) = (layer.attention_input(x, residual) for layer in layers)
    assert rel_err(qkv, want_qkv) < 2e-2 and torch.equal(res, want_res)
    (out, res), (want_out, want_res) = (layer.after_attention(attn_out, x) for layer in layers)
    # Gemma's sandwich norm of the attention output runs before the residual add, in Triton on
    # one side and torch on the other: equal up to their rounding, not to the bit.
    assert rel_err(out, want_out) < 2e-2 and rel_err(res, want_res) < 1e-2
    # The fused route was taken: the norms hand their projections FP8 rows.
    layer = layers[0]
    assert isinstance(layer.input_layernorm(x, residual, True)[0], FP8Rows)
    mlp_norm = layer.pre_feedforward_layernorm if layer.sandwich else layer.post_attention_layernorm
    assert layer.mlp.gate_up_proj.is_fp8 and isinstance(mlp_norm(x, residual, True)[0], FP8Rows)


PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Explain why the sky is blue.",
    "Translate 'good morning' to Spanish:",
]


def test_fp8_weights_keep_most_greedy_tokens_of_the_built_in_model():
    """Teacher-forced: the FP8 model's greedy choice after each prefix of the unquantized
    model's own output (a first difference would otherwise make every later token differ)."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with LLM(model="smollm2-135m-instruct", max_model_len=256) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, params)]
        prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    with LLM(model="smollm2-135m-instruct", max_model_len=256, quantization="fp8") as llm:
        prefixes = [
            ids + ref[:i]
            for ids, ref in zip(prompt_ids, reference, strict=True)
            for i in range(len(ref))
        ]
        chosen = [o.token_ids[0] for o in llm.generate(prefixes, one)]
    expected = [t for ref in reference for t in ref]
    agreement = sum(a == b for a, b in zip(chosen, expected, strict=True)) / len(expected)
    assert agreement >= 0.8, f"FP8 weights chose the unquantized model's token {agreement:.0%}"


def test_triton_quantization_matches_quantize_rows():
    """The fused kernel (compiled on a GPU, interpreted on CPU) against the torch version."""
    from tests.triton_setup import DEVICE, import_kernels

    kernels = import_kernels("sparse_core.kernels.triton_fp8")
    x = torch.randn(5, 3000, device=DEVICE, dtype=torch.float32) * torch.logspace(
        -2, 2, 5, device=DEVICE
    ).unsqueeze(1)
    x[3] = 0
    wide = torch.cat([x, torch.full_like(x[:, :7], float("nan"))], dim=1)[:, :3000]  # row stride
    got_fp8, got_scale = kernels.quantize_rows(wide)
    want_fp8, want_scale = quantize_rows(x)
    assert torch.allclose(got_scale, want_scale, rtol=1e-6)
    got, want = got_fp8.float(), want_fp8.float()
    assert (got[3] == 0).all()
    # Equal but for the rounding of values that fall half-way between two e4m3 numbers.
    assert (got != want).float().mean().item() < 1e-3


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("in_features", [256, 201])  # a whole number of key tiles, and not
# bf16: as pre-quantized checkpoints often store their weight scales
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_few_rows_matmul_matches_the_reference(rows, in_features, scale_dtype):
    """The decode-size matmul (compiled on a GPU, interpreted on CPU) against the float32
    reference, into a strided output of which nothing else is written; 40 rows take several
    row tiles on CPU."""
    from tests.triton_setup import DEVICE, import_kernels

    kernels = import_kernels("sparse_core.kernels.triton_fp8")
    x = torch.randn(rows, in_features, device=DEVICE) * 3
    w_fp8, w_scale = quantize_rows(torch.randn(72, in_features, device=DEVICE))
    w_scale = w_scale.to(scale_dtype)
    x_fp8, x_scale = quantize_rows(x)
    out = torch.full((rows, 80), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    got = kernels.few_rows_matmul(x_fp8, x_scale, w_fp8, w_scale, out[:, 4:76])
    want = (x_fp8.float() * x_scale) @ (w_fp8.float() * w_scale.float()).t()
    assert rel_err(got.float(), want) < 5e-3  # one bf16 rounding
    assert out[:, :4].isnan().all() and out[:, 76:].isnan().all()
