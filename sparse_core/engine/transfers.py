"""Host <-> device copies that never make the host wait for the device.

A copy from pageable host memory may wait for the stream to drain before it starts; from pinned
memory it is queued like a kernel. That matters when the host prepares a step while the previous
one is still running (`EngineConfig.async_scheduling`).
"""

from __future__ import annotations

import torch


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


class PendingTokens:
    """Token ids on their way from the device: the copy is queued now, read when needed."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.device_ids = tokens  # kept for a step launched before they reach the host
        self.ready: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = tokens

    def tolist(self) -> list[int]:
        """The ids, waiting for the device until they are copied (and no longer)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
