"""Each running sequence's next input token, on the device (mini-sglang's token pool, one entry
per sequence: its row of the block manager's tables, `Sequence.table_row`).

Every step's sampled tokens are written to their sequences' entries as they are chosen, and a
decode step reads from the entries the inputs the host does not have yet: with async scheduling
a step is launched before the one in flight has its tokens read, and its decode rows are fed
those tokens from here. Plain and overlapped steps build and run the same way; only what the
host knows when it builds a step differs (`IN_FLIGHT` marks the rest).
"""

from __future__ import annotations

import torch

# A decode row's input id in DecodeBatch when it is the token the step in flight samples: read
# from the row's entry on the device.
IN_FLIGHT = -1


class DeviceTokens:
    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        self.next_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)

    def record(self, entries: torch.Tensor, sampled: torch.Tensor) -> None:
        """A step's sampled tokens [B] into its sequences' `entries` [B] (on the device). Rows
        whose sample is not an output (a chunk's, a forced prompt token's) write one too: their
        next input is a prompt token, which the host gives."""
        self.next_ids[entries] = sampled

    def inputs(self, input_ids: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """A decode step's input ids [B] on the device: `input_ids` where the host gave them,
        the entry's token where it is `IN_FLIGHT`."""
        return torch.where(input_ids == IN_FLIGHT, self.next_ids[entries], input_ids)
