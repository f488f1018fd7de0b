"""Host <-> device copies that never make the host wait for the device.

A copy from pageable host memory may wait for the stream to drain before it starts; from pinned
memory it is queued like a kernel. That matters when the host prepares a step while the previous
one is still running (`EngineConfig.async_scheduling`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_core.outputs import TokenLogprobs


def to_device(
    values: list | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Host values (a nested list of numbers, or a CPU tensor of `dtype`) as a tensor on
    `device`, copied without a wait."""
    return _pinned(values, dtype, device).to(device, non_blocking=True)


def copy_into(target: torch.Tensor, values: list | torch.Tensor) -> None:
    """Host values (a list or a CPU tensor) into the device tensor `target`, without a wait."""
    target.copy_(_pinned(values, target.dtype, target.device), non_blocking=True)


def _pinned(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The values as a host tensor, page-locked when bound for a GPU (as is, for a CPU)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return host.pin_memory() if device.type == "cuda" else host


@dataclass
class SampledLogprobs:
    """Logprobs of the rows of a step that asked for them, on the device: for the step's `rows`
    in order, `values` float32 [R, 1 + K] (the sampled token's, then the K most likely tokens',
    most likely first) and `top_ids` int64 [R, K]; row i keeps the first `num_top[i]` of K."""

    rows: list[int]
    num_top: list[int]
    values: torch.Tensor
    top_ids: torch.Tensor


class PendingTokens:
    """A step's sampled token ids, and the logprobs of its rows that asked for them, on their
    way from the device: the copies are queued now, behind one event, and read when needed."""

    def __init__(self, tokens: torch.Tensor, logprobs: SampledLogprobs | None = None) -> None:
        self.ready: torch.cuda.Event | None = None
        self._logprobs = logprobs
        tensors = [tokens] if logprobs is None else [tokens, logprobs.values, logprobs.top_ids]
        if tokens.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, device in zip(self._host, tensors, strict=True):
                host.copy_(device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self._host = tensors

    def _wait(self) -> None:
        """Until the copies are done (and no longer)."""
        if self.ready is not None:
            self.ready.synchronize()

    def tolist(self) -> list[int]:
        """The ids, waiting for the device until they are copied."""
        self._wait()
        return self._host[0].tolist()

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per row: its sampled token's logprobs, None where it did not ask."""
        rows: list[TokenLogprobs | None] = [None] * len(self._host[0])
        if self._logprobs is None:
            return rows
        self._wait()
        ids, values, top_ids = (t.tolist() for t in self._host)
        for i, (row, k) in enumerate(zip(self._logprobs.rows, self._logprobs.num_top, strict=True)):
            top = list(zip(top_ids[i][:k], values[i][1 : k + 1], strict=True))
            rows[row] = TokenLogprobs(ids[row], values[i][0], top)
        return rows
