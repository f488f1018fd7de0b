"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

Steps that only decode (no prompt joins them) replay a graph. A decode step of a 32-layer model
launches hundreds of small kernels; replaying a captured graph removes their launch cost.
Everything a step reads lives in static buffers: token ids (the host's, and for the tokens it
does not have yet the sequences' entries of the device token pool), positions, and for every
layer group its slot mapping, block tables and context lengths. A batch runs in the smallest
bucket that holds it; padding rows write nowhere (slot -1) and attend to one token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_core.engine.device_tokens import DeviceTokens
from sparse_core.models.attention import DecodeGroupMetadata, DecodeMetadata, StepMetadata
from sparse_core.models.llama import LlamaForCausalLM
from sparse_core.transfers import copy_into


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, every multiple of 8 below max_num_seqs, and max_num_seqs: few padding rows in
    any bucket."""
    small = [b for b in (1, 2, 4) if b < max_num_seqs]
    return small + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


def decode_graph_bytes(max_num_seqs: int, vocab_size: int, dtype_bytes: int, tp_size: int) -> int:
    """GPU memory the decode graphs take: the shared float32 logits buffer, plus their pool,
    which holds the largest step's logits in the model's dtype (under tensor parallelism, the
    rank's slice, the gathered parts and their concatenation: under 3 copies) and its other
    activations (256 MiB is ample for an 8B model at 256 sequences); at least 512 MiB."""
    rows = vocab_size * max_num_seqs
    pooled_logits = dtype_bytes * rows * (1 if tp_size == 1 else 3)
    return max(512 * 2**20, 4 * rows + pooled_logits + 256 * 2**20)


@dataclass
class DecodeBatch:
    """Host-side description of a step's decode part: one token per running sequence."""

    input_ids: torch.Tensor  # int64 [B]: each row's input, IN_FLIGHT where the host lacks it
    table_rows: torch.Tensor  # int64 [B]: each row's sequence's entry in the DeviceTokens
    positions: list[int]
    slots: torch.Tensor  # int64 [groups, B]: where each sequence's new token goes
    block_tables: torch.Tensor  # int32 [groups, B, most blocks]
    context_lens: torch.Tensor  # int32 [groups, B]: tokens held, the new one included
    # (all on the host)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokens: DeviceTokens,
        num_groups: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_context_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.tokens = tokens
        self.max_context_len = max_context_len
        m = max_num_seqs
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.table_rows = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slots = torch.full((num_groups, m), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(
            (num_groups, m, max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.lens = torch.ones((num_groups, m), dtype=torch.int32, device=device)
        # Every graph writes its logits here: one buffer for all buckets, outside their pool.
        vocab_size = model.config.vocab_size
        self.logits = torch.zeros((m, vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.buckets = batch_buckets(max_num_seqs)

    def _meta(self, batch: int) -> StepMetadata:
        groups = [
            DecodeGroupMetadata(
                slot_mapping=self.slots[g, :batch],
                block_tables=self.tables[g, :batch],
                context_lens=self.lens[g, :batch],
                max_context_len=self.max_context_len,
            )
            for g in range(self.slots.shape[0])
        ]
        return StepMetadata(decode=DecodeMetadata(groups))

    def _forward(self, batch: int) -> None:
        ids = self.tokens.inputs(self.input_ids[:batch], self.table_rows[:batch])
        hidden = self.model(ids, self.positions[:batch], self._meta(batch))
        self.model.compute_logits(hidden, out=self.logits[:batch])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool.

        The pool is these graphs' own (the prefill graphs have another); it holds only what a
        step needs while it runs, as the logits go to the shared buffer."""
        pool = None
        for batch in reversed(self.buckets):
            self._forward(batch)  # warm-up: Triton compiles and autotunes outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(batch)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def run(self, step: DecodeBatch) -> torch.Tensor:
        """Logits [B, V] of the step: a view into the shared buffer, which the next replay
        overwrites (work queued before that replay still reads this step's)."""
        batch = len(step.input_ids)
        bucket = next(b for b in self.buckets if b >= batch)
        copy_into(self.input_ids[:batch], step.input_ids)
        copy_into(self.table_rows[:batch], step.table_rows)
        copy_into(self.positions[:batch], step.positions)
        copy_into(self.tables[:, :batch, : step.block_tables.shape[2]], step.block_tables)
        copy_into(self.slots[:, :batch], step.slots)
        copy_into(self.lens[:, :batch], step.context_lens)
        # Padding rows: no write, one token of context.
        self.slots[:, batch:bucket].fill_(-1)
        self.lens[:, batch:bucket].fill_(1)
        self.graphs[bucket].replay()
        return self.logits[:batch]
