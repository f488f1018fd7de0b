"""Fused element-wise Triton kernels against their plain-torch references.

On CPU they run under Triton's interpreter; with CUDA, compiled, at realistic sizes too.
"""

from __future__ import annotations

import pytest
import torch

from sparse_core.kernels import reference as ref
from tests.triton_setup import DEVICE, HAS_CUDA, import_kernels

tf = import_kernels("sparse_core.kernels.triton_fused")

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
SIZES = [(5, 48)] + ([(300, 4096)] if HAS_CUDA else [])


def close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), SIZES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, rows, cols, with_residual):
    x = torch.randn(rows, cols, device=DEVICE).to(dtype)
    residual = torch.randn(rows, cols, device=DEVICE).to(dtype) if with_residual else None
    weight = torch.rand(cols, device=DEVICE).to(dtype) + 0.5
    out, res = tf.rms_norm(x, weight, 1e-5, residual)
    expected, expected_res = ref.rms_norm(x, weight, 1e-5, residual)
    close(out, expected, dtype)
    close(res, expected_res, dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), SIZES)
def test_act_and_mul(dtype, rows, cols, activation):
    x = (3 * torch.randn(rows, 2 * cols, device=DEVICE)).to(dtype)
    close(tf.act_and_mul(x, activation), ref.act_and_mul(x, activation), dtype)


def assert_same_fp8(got, want):
    """Quantized activations (`FP8Rows`) equal but for values half-way between two e4m3
    numbers, which the kernel's division may round the other way (at most one in a thousand,
    or one)."""
    assert got.dtype == want.dtype and got.values.shape == want.values.shape
    torch.testing.assert_close(got.scale, want.scale, rtol=1e-6, atol=0)
    mismatched = (got.values.float() != want.values.float()).sum().item()
    allowed = max(1, got.values.numel() // 1000)  # a small tensor may hold one such value
    assert mismatched <= allowed, f"{mismatched} of {got.values.numel()} e4m3 values differ"


# Rows of one pass and of two (act_and_mul_fp8; on a GPU two past 16,384 columns).
FP8_SIZES = [(5, 48), (4, 3000)] + ([(300, 4096), (40, 14336), (3, 20000)] if HAS_CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), FP8_SIZES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_quantizes_as_the_fp8_layer_would(dtype, rows, cols, with_residual):
    """The norm's output quantized in the norm's kernel, against the reference norm then the
    per-row quantization an FP8 linear layer applies; a zero row takes the smallest scale."""
    x = (torch.randn(rows, cols, device=DEVICE) * 4).to(dtype)
    x[1] = 0
    residual = torch.randn(rows, cols, device=DEVICE).to(dtype) if with_residual else None
    if residual is not None:
        residual[1] = 0
    weight = torch.rand(cols, device=DEVICE).to(dtype) + 0.5
    got, got_res = tf.rms_norm_fp8(x, weight, 1e-5, residual)
    want, want_res = ref.rms_norm_fp8(x, weight, 1e-5, residual)
    assert_same_fp8(got, want)
    assert (got.values[1].float() == 0).all()
    close(got_res, want_res, dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), FP8_SIZES)
def test_act_and_mul_fp8_quantizes_as_the_fp8_layer_would(dtype, rows, cols, activation):
    """Rows wider than one block (3,000 and 14,336 columns) take the kernel's two passes over
    several blocks; a row whose largest product sits in its last block checks the first."""
    x = (3 * torch.randn(rows, 2 * cols, device=DEVICE)).to(dtype)
    x[0, cols - 1] = x[0, 2 * cols - 1] = 40.0  # gate and up of the row's last column
    got = tf.act_and_mul_fp8(x, activation)
    assert_same_fp8(got, ref.act_and_mul_fp8(x, activation))
    assert got.values[0, -1].float().item() == 448.0  # its largest maps to e4m3's largest


def test_an_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="unsupported activation 'relu'"):
        tf.act_and_mul(torch.zeros(2, 8, device=DEVICE), "relu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_launches_with_aligned_then_misaligned_and_odd_sized_arguments(dtype):
    """The launcher reuses a compiled kernel only for arguments Triton would compile the same:
    after a launch on 16-byte-aligned rows of 4096 columns, rows that start 2 bytes off and are
    4095 columns long get their own binary (a wrong reuse reads misaligned or past the row)."""
    weight = torch.rand(4096, device=DEVICE).to(dtype) + 0.5
    flat = torch.randn(3 * 4096 + 1, device=DEVICE).to(dtype)
    for x in (flat[: 3 * 4096].view(3, 4096), flat[1:].view(3, 4096), flat[1:4096].view(1, 4095)):
        for _ in range(2):  # the second launch of each takes the cached binary
            out, _ = tf.rms_norm(x, weight[: x.shape[1]], 1e-5)
            close(out, ref.rms_norm(x, weight[: x.shape[1]], 1e-5)[0], dtype)


@pytest.mark.skipif(not HAS_CUDA, reason="the interpreter bypasses the launcher's cache")
def test_first_launches_of_a_variant_are_listed_and_later_ones_not():
    """A call that loads or compiles a kernel variant is listed, with its constexprs and host
    time; the next call of the same variant is not."""
    from sparse_core.kernels import kernel_first_launch_count, kernel_first_launches

    x = torch.randn(2, 1000 + 3, device=DEVICE)  # a row length no other test launches
    weight = torch.ones(x.shape[1], device=DEVICE)
    before = kernel_first_launch_count()
    tf.rms_norm(x, weight, 1e-5)
    first = kernel_first_launches(before)
    tf.rms_norm(x, weight, 1e-5)
    assert [launch.kernel for launch in first] == ["_rms_norm_kernel"]
    assert first[0].seconds > 0 and "BLOCK=1024" in str(first[0])
    assert kernel_first_launch_count() == before + 1


def test_launcher_keys_tell_apart_what_triton_compiles_apart():
    """Arguments that Triton specialises differently never share a key; those it compiles the
    same share one (on CPU tensors too: the key reads only dtypes and addresses)."""
    from sparse_core.kernels.launcher import _arg_key

    flat = torch.zeros(64, dtype=torch.bfloat16)
    aligned, misaligned = flat[:8], flat[1:9]
    assert _arg_key(aligned) != _arg_key(misaligned)
    assert _arg_key(aligned) != _arg_key(aligned.float())
    assert _arg_key(aligned) == _arg_key(flat[8:16])  # 16 bytes further: aligned too
    assert len({_arg_key(n) for n in (1, 16, 17, 2**31)}) == 4  # ==1, %16, neither, i64
    assert _arg_key(32) == _arg_key(48) and _arg_key(3) == _arg_key(5)
    assert _arg_key(True) != _arg_key(False) and _arg_key(None) is None
    assert _arg_key(0.5) == _arg_key(2.0)
