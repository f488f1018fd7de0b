"""Linear and embedding layers sharded over the tensor-parallel ranks (Megatron-style).

Each layer takes full (unsharded) sizes and keeps its rank's part; `load_full` copies that part
out of a full Hugging Face tensor. With one rank they are the plain torch layers: same
parameters, same matmul, no collective.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from sparse_core.distributed.communication import all_gather, all_reduce
from sparse_core.distributed.parallel_state import get_tp_rank, get_tp_size
from sparse_core.kernels.fp8 import FP8_DTYPE, FP8Rows, fp8_linear_reference, quantize_rows


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"shape mismatch for {name!r}: model {tuple(dst.shape)}, checkpoint {tuple(src.shape)}"
        )
    dst.copy_(src)


def shard(full: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    """Rank's 1/size of `full` along dim (a view)."""
    if full.dim() <= dim or full.shape[dim] % size:
        raise ValueError(
            f"checkpoint tensor {name!r} of shape {tuple(full.shape)} cannot be split "
            f"{size} ways along dimension {dim}"
        )
    part = full.shape[dim] // size
    return full.narrow(dim, rank * part, part)


def _split(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size {tp_size}")
    return size // tp_size


_QUANTIZE_AT_LOAD = contextvars.ContextVar("quantize_at_load", default=False)


@contextlib.contextmanager
def quantize_at_load(enabled: bool = True) -> Iterator[None]:
    """QuantizableLinear layers built inside hold FP8 weights from the start, and `load_full`
    quantizes each unquantized checkpoint tensor as it loads (`quantization="fp8"`): the model
    never holds its projections in the checkpoint's dtype (22 GiB of bf16 for a 12B model,
    before quantizing would bring it to 12)."""
    token = _QUANTIZE_AT_LOAD.set(enabled)
    try:
        yield
    finally:
        _QUANTIZE_AT_LOAD.reset(token)


class QuantizableLinear(nn.Linear):
    """A linear layer (no bias in its matmul) whose weight may be FP8: e4m3 with one scale per
    output row of this rank (sparse_core/kernels/fp8.py), from a pre-quantized checkpoint
    (`expect_fp8`) or quantized as it loads (built under `quantize_at_load`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # (out, 1) float32 once FP8; a buffer, so that the model's `.to()` moves it with the
        # weight (not saved: the loader fills it).
        self.register_buffer("weight_scale", None, persistent=False)
        # Built under `quantize_at_load`: unquantized tensors are rounded to the model's dtype
        # and quantized per row of this rank as they load (as if the model had been loaded in
        # its dtype and quantized after).
        self.quantizes_at_load = _QUANTIZE_AT_LOAD.get()
        self.load_dtype = self.weight.dtype
        if self.quantizes_at_load:
            self.expect_fp8()

    def _loaded(
        self, part: torch.Tensor, scale_rows: torch.Tensor | None, name: str
    ) -> torch.Tensor:
        """This rank's part of a checkpoint weight as the layer stores it: quantized, its scales
        written into `scale_rows`, where the layer quantizes at load and the part is not FP8."""
        if not self.quantizes_at_load or part.dtype == FP8_DTYPE:
            return part
        assert scale_rows is not None
        part_fp8, scale = quantize_rows(part.to(self.weight.device, self.load_dtype))
        copy_checked(scale_rows, scale, name)
        return part_fp8

    def expect_fp8(self) -> None:
        """Room for FP8 weights and their scales (one per output row: `quantize_rows`), which
        `load_full` fills from a pre-quantized checkpoint as stored, or quantizes into."""
        if self.weight.dtype == FP8_DTYPE:
            return
        self.weight = nn.Parameter(
            torch.empty_like(self.weight, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale = torch.empty(
            self.weight.shape[0], 1, dtype=torch.float32, device=self.weight.device
        )

    @property
    def is_fp8(self) -> bool:
        """Whether the weight is FP8: the layer then takes its input quantized (`FP8Rows`)
        from the kernel that produces it, or quantizes it itself."""
        return self.weight.dtype == FP8_DTYPE

    def matmul(self, x: torch.Tensor | FP8Rows, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T, into `out` if given."""
        if self.is_fp8:
            if x.device.type == "cuda":
                from sparse_core.kernels.triton_fp8 import fp8_linear_cuda  # imports Triton

                return fp8_linear_cuda(x, self.weight, self.weight_scale, out)
            y = fp8_linear_reference(x, self.weight, self.weight_scale)
            return y if out is None else out.copy_(y)
        if out is not None:
            return torch.mm(x, self.weight.t(), out=out)
        return F.linear(x, self.weight)


class ColumnParallelLinear(QuantizableLinear):
    """Output features split over ranks; each rank computes its slice, no communication.

    `output_sizes` are the full sizes of the projections fused into this layer (q, k, v or
    gate, up). A rank keeps its 1/tp of each, side by side: [q_r | k_r | v_r] or
    [gate_r | up_r], so the usual split of the fused output still works on every rank, and q/k/v
    rows cut at multiples of head_dim give each rank whole heads.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.output_sizes = [_split(s, self.tp_size, "output size") for s in output_sizes]
        super().__init__(in_features, sum(self.output_sizes), bias=bias)

    def forward(self, x: torch.Tensor | FP8Rows) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def load_full(self, param: torch.Tensor, full: torch.Tensor, index: int, name: str) -> None:
        """Copy this rank's rows of fused part `index` (weight, FP8 weight scales or bias) from
        the full tensor."""
        part = shard(full, 0, self.tp_rank, self.tp_size, name)
        if param is self.weight:
            scales = self.weight_scale
            part = self._loaded(
                part, None if scales is None else scales.split(self.output_sizes)[index], name
            )
        copy_checked(param.split(self.output_sizes, dim=0)[index], part, name)


class RowParallelLinear(QuantizableLinear):
    """Input features split over ranks; the partial outputs are summed (one all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(_split(in_features, self.tp_size, "input size"), out_features, bias)

    def forward(self, x: torch.Tensor | FP8Rows, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: where the result goes (rows of a larger tensor): written there by the matmul
        without tensor parallelism or a bias, copied there otherwise."""
        if self.tp_size == 1 and self.bias is None:
            return self.matmul(x, out)  # bf16: written into `out` by the matmul, no copy
        y = self.matmul(x)
        if self.tp_size > 1:
            y = all_reduce(y)
        y = y if self.bias is None else y + self.bias  # the bias once, after the sum
        return y if out is None else out.copy_(y)

    def load_full(self, param: torch.Tensor, full: torch.Tensor, index: int, name: str) -> None:
        if param is self.bias or param is self.weight_scale:  # per output row: every rank's
            copy_checked(param, full, name)
        else:
            part = shard(full, 1, self.tp_rank, self.tp_size, name)
            copy_checked(param, self._loaded(part, self.weight_scale, name), name)


class VocabParallelEmbedding(nn.Embedding):
    """Vocabulary rows split over ranks: each rank looks up the ids it holds, zeros the others,
    and one all-reduce assembles the embeddings."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        local = _split(vocab_size, self.tp_size, "vocab_size")
        super().__init__(local, dim)
        self.vocab_start = self.tp_rank * local

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))

    def load_full(self, param: torch.Tensor, full: torch.Tensor, index: int, name: str) -> None:
        copy_checked(param, shard(full, 0, self.tp_rank, self.tp_size, name), name)


class ParallelLMHead(nn.Linear):
    """Vocabulary rows split over ranks; the logit slices are all-gathered, so every rank has
    the full logits (rank 0 samples). Shares its weight with a VocabParallelEmbedding when the
    embeddings are tied: both hold the same rows."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(hidden_size, _split(vocab_size, self.tp_size, "vocab_size"), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return logits if self.tp_size == 1 else all_gather(logits, dim=-1)

    def load_full(self, param: torch.Tensor, full: torch.Tensor, index: int, name: str) -> None:
        copy_checked(param, shard(full, 0, self.tp_rank, self.tp_size, name), name)
