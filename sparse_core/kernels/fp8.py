"""FP8 (e4m3) linear layers: weights with one scale per output channel, activations with one
scale per token computed on the fly ("FP8-Dynamic", vLLM's `--quantization fp8`).

On GPUs with FP8 tensor cores (compute capability 8.9: Ada, e.g. the RTX 4090; 9.0: Hopper) the
matmul runs through `torch._scaled_mm` (cuBLASLt) with row-wise scales and a bf16/fp16 output:
`fp8_linear_cuda` in sparse_core/kernels/triton_fp8.py, beside the kernel that quantizes its
activations. Everywhere else `fp8_linear_reference` dequantizes and multiplies in float32: the
CPU path and the oracle of the GPU one. Both quantize the activations the same way, so they
differ only by the matmul's rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Scales never go below this: an all-zero row (weights, or a padding token's activations) would
# otherwise divide by zero.
MIN_SCALE = 1e-12


class KVScales(NamedTuple):
    """One layer's FP8 KV cache scales (`EngineConfig.kv_cache_dtype="fp8"`): the cache holds
    k / k_scale and v / v_scale in e4m3, saturated to its range, and readers multiply back.

    One scale per layer for K and one for V (vLLM's granularity). The engine keeps them at 1.0,
    as vLLM does for a checkpoint without calibrated scales (loading such scales is not
    implemented); the kernels take any. A kernel writing into a cache of a wider dtype divides
    by scales of 1.0, which changes nothing.
    """

    k: float = 1.0
    v: float = 1.0

    def inverse(self) -> KVScales:
        """The scales that, "dividing" on a copy out of an FP8 cache, dequantize it."""
        return KVScales(1.0 / self.k, 1.0 / self.v)


UNIT_SCALES = KVScales()


def supports_fp8(device: torch.device) -> bool:
    """Whether `device` runs FP8 matmuls natively (else the reference path is used: on CPU for
    tests; on an older GPU, refused at start-up because it would be slower than bf16)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a 2-D tensor in e4m3 with its own float32 scale: (x_fp8, scale (rows, 1)),
    x ~= x_fp8 * scale. The largest magnitude of a row maps to 448."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_(min=MIN_SCALE)
    x_fp8 = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, scale


@dataclass(frozen=True)
class FP8Rows:
    """Activations quantized per token for an FP8 linear layer (`quantize_rows`), by the kernel
    that produced them (an RMSNorm, the MLP's activation) rather than by a pass of their own.
    Indexes and measures rows like the tensor it stands for: `len`, `[rows]`, `dtype`,
    `device`."""

    values: torch.Tensor  # e4m3 (rows, features)
    scale: torch.Tensor  # float32 (rows, 1): values * scale ~= the activations
    dtype: torch.dtype  # the activations' dtype, which the layer's output takes

    def __len__(self) -> int:
        return self.values.shape[0]

    def __getitem__(self, rows: slice) -> FP8Rows:
        return FP8Rows(self.values[rows], self.scale[rows], self.dtype)

    @property
    def device(self) -> torch.device:
        return self.values.device


def quantize_activations(x: torch.Tensor) -> FP8Rows:
    """x (rows, features) quantized per row, as an FP8 linear layer takes it."""
    return FP8Rows(*quantize_rows(x), x.dtype)


def fp8_linear_reference(
    x: torch.Tensor | FP8Rows, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """y = x @ W^T with W = weight (out, in) e4m3 x weight_scale (out, 1), x quantized per token
    (unless given quantized); dequantized and computed in float32, returned in x's dtype."""
    if isinstance(x, FP8Rows):
        rows, shape = x, x.values.shape
    else:
        rows, shape = quantize_activations(x.reshape(-1, x.shape[-1])), x.shape
    w = weight.float() * weight_scale
    y = (rows.values.float() * rows.scale) @ w.t()
    return y.to(rows.dtype).reshape(*shape[:-1], weight.shape[0])
