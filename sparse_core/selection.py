"""Which prompt tokens a sparse layer keeps: the selection policies, behind one interface.

A `SelectionPolicy` chooses, for a prefill step's prompts, the rows of the packed keys each KV
head keeps: as many as each prompt's group keeps of it (PromptBatch.kept). `selection_policy` builds one per rank from the sparsity config, with the
rank's kernels, its own random generator (seeded from SparsityConfig.seed) and the rank's KV
heads among the model's; the native engine's attention layers (through the step's
PrefillMetadata) and the vLLM plugin's backend both call it. How many tokens a prompt keeps comes
with each call, since layer groups and prompt lengths differ in it; which layers keep what is the
layer plan's business (sparse_core/policy.py).

Adding a policy: write its class here with a `select` method (a policy that ranks tokens by a
score only needs `scores`: subclass `_TopScores`), add its name to config.POLICIES and its
constructor to `selection_policy`. Nothing else needs to know it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from sparse_core.config import SparsityConfig
from sparse_core.kernels import KernelOps
from sparse_core.kernels.reference import ragged_rows
from sparse_core.transfers import to_device


@dataclass
class PromptBatch:
    """Prompts packed in a prefill step: host bounds, and the same on the device (built once per
    step, so the layers do no host-to-device copies, which would stall the launch queue; copied
    from page-locked memory, so that a step prepared while the one before it runs does not wait
    for it)."""

    bounds: list[tuple[int, int]]  # [start, end) of each prompt in the packed keys
    kept: list[int]  # tokens each prompt keeps per KV head (fewer than its length)
    starts: torch.Tensor
    lengths: torch.Tensor
    kept_offsets: torch.Tensor  # [S + 1]: where each prompt's kept rows start in the output
    # Where each prompt's window queries end in the packed queries: the ends of `bounds`, unless
    # the step's keys are packed apart from its queries (a prompt's last chunk, whose earlier
    # chunks' keys were gathered from the cache).
    query_ends: list[int]

    @classmethod
    def from_bounds(
        cls,
        bounds: list[tuple[int, int]],
        kept: list[int],
        device: torch.device,
        query_ends: list[int] | None = None,
    ) -> PromptBatch:
        # One copy of starts, lengths and offsets, each a contiguous slice (the selection
        # kernel reads them as plain arrays; a column of a [S, 2] tensor would read every other
        # value).
        s = len(bounds)
        starts = [start for start, _ in bounds]
        lengths = [end - start for start, end in bounds]
        offsets = [0, *itertools.accumulate(kept)]
        on_device = to_device(starts + lengths + offsets, torch.int64, device)
        ends = [end for _, end in bounds] if query_ends is None else query_ends
        return cls(bounds, kept, on_device[:s], on_device[s : 2 * s], on_device[2 * s :], ends)


class SelectionPolicy(Protocol):
    def select(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        lse: torch.Tensor | None,
        prompts: PromptBatch,
        scale: float,
    ) -> torch.Tensor:
        """Rows of the packed K/V that a layer keeps, per KV head, for several prompts at once.

        q [T, Hq, D] and k [T', Hkv, D] are a prefill step's packed queries and keys (RoPE
        applied); lse [Hq, T] the attention kernel's row LSE, or None to compute the window
        rows' LSE here; prompts: the prompts to compress and how many tokens each keeps.
        Returns int64 [Hkv, sum(prompts.kept)]: prompt j's kept rows, ascending, in the columns
        from prompts.kept_offsets[j]. Every step after the scores is batched over the prompts,
        so the launches per layer do not grow with the number of prompts.
        """
        ...


@dataclass
class StreamingLLM:
    """The first `sinks` tokens and the most recent of the rest."""

    sinks: int

    def select(self, q, k, lse, prompts, scale) -> torch.Tensor:
        sinks, offsets = self.sinks, prompts.kept_offsets
        columns = torch.arange(max(prompts.kept), device=k.device)
        # Column c of prompt j (keeping kept_j of n_j tokens): token c among the sinks, else
        # token n_j - kept_j + c, so the last column kept is the prompt's last token (columns
        # past kept_j are dropped by ragged_rows).
        recent = (prompts.lengths - offsets.diff()).unsqueeze(1) + columns
        positions = torch.where(columns < sinks, columns, recent)
        by_head = positions.unsqueeze(1).expand(-1, k.shape[1], -1)
        return ragged_rows(by_head, offsets, sum(prompts.kept), prompts.starts)


@dataclass
class _TopScores:
    """Keeps the sinks, the observation window (the last `window` prompt tokens) and the
    best-scored of the rest, after pooling the scores over neighbouring tokens."""

    ops: KernelOps
    window: int
    sinks: int
    pooling: str
    kernel_size: int

    def select(self, q, k, lse, prompts, scale) -> torch.Tensor:
        scores = [
            self.scores(q, k, lse, bounds, query_end, scale)
            for bounds, query_end in zip(prompts.bounds, prompts.query_ends, strict=True)
        ]
        return self.ops.select_kept_rows(
            scores,
            prompts.lengths - self.window,
            prompts.starts,
            prompts.kept_offsets,
            prompts.kept,
            self.window,
            self.sinks,
            self.pooling,
            self.kernel_size,
        )

    def scores(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        lse: torch.Tensor | None,
        bounds: tuple[int, int],
        query_end: int,
        scale: float,
    ) -> torch.Tensor:
        """[Hkv, n - window] float32 scores of one prompt's non-window tokens: keys k[bounds],
        window queries q[query_end - window : query_end]."""
        raise NotImplementedError


@dataclass
class SnapKV(_TopScores):
    """Scores: the attention the window's queries give each token (snapkv, and pyramid, whose
    budgets differ by layer but whose selection is the same)."""

    gqa_reduce: str

    def scores(self, q, k, lse, bounds, query_end, scale) -> torch.Tensor:
        start, end = bounds
        window, ops = self.window, self.ops
        q_win, keys = q[query_end - window : query_end], k[start:end]
        lse_win = (
            ops.window_lse(q_win, keys, scale)
            if lse is None
            else lse[:, query_end - window : query_end]
        )
        return ops.window_scores(q_win, keys, lse_win, scale, self.gqa_reduce)


@dataclass
class RandomScores(_TopScores):
    """Scores: uniform draws from the policy's own generator, a baseline that ignores
    attention. It draws for all of the model's KV heads and keeps this rank's (kv_heads:
    (first, total); None: k holds every head), so any TP size keeps the same tokens."""

    generator: torch.Generator
    kv_heads: tuple[int, int] | None = None

    def scores(self, q, k, lse, bounds, query_end, scale) -> torch.Tensor:
        start, end = bounds
        first, total = self.kv_heads or (0, k.shape[1])
        scores = torch.rand(total, end - start - self.window, generator=self.generator)
        return scores[first : first + k.shape[1]].to(k.device)


def selection_policy(
    sparsity: SparsityConfig, ops: KernelOps, kv_heads: tuple[int, int] | None = None
) -> SelectionPolicy | None:
    """The policy of a rank (None for dense: nothing is selected). `kv_heads`: (first, total)
    of the rank's KV heads among the model's, under tensor parallelism. Each call makes a new
    policy with a new generator: a step that must not move the serving policy's random stream
    (the start-up profile) runs one of its own."""
    s = sparsity
    if s.policy == "dense":
        return None
    if s.policy == "streamingllm":
        return StreamingLLM(s.sinks)
    if s.policy == "random":
        generator = torch.Generator().manual_seed(s.seed)
        return RandomScores(ops, s.window, s.sinks, s.pooling, s.kernel_size, generator, kv_heads)
    assert s.policy in ("snapkv", "pyramid"), s.policy  # SparsityConfig checks the name
    return SnapKV(ops, s.window, s.sinks, s.pooling, s.kernel_size, s.gqa_reduce)
