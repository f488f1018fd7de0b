"""Next-token choice for a batch: greedy rows by argmax, the rest by temperature, top-k, top-p."""

from __future__ import annotations

import torch

from sparse_core.engine.sequence import Sequence


def sample(
    logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator, wanted: list[bool]
) -> list[int | None]:
    """logits [B, V] float32 -> one token id per sequence, None where not `wanted`.

    A sequence with a `seed` draws from its own generator, so its output does not depend on what
    else is in the batch; the others share the engine's generator. Rows that are not wanted (a
    forced prompt token's prediction) draw nothing, so a split prompt samples like a whole one.
    """
    tokens: list[int | None] = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        params = seq.params
        if not wanted[row]:
            tokens[row] = None
            continue
        if params.greedy:
            continue
        scores = logits[row].cpu() / params.temperature
        if params.top_k > 0:
            kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_scores, order = scores.sort(descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            # Drop a token when the tokens ranked above it already cover top_p.
            drop = cumulative - sorted_scores.softmax(-1) >= params.top_p
            scores[order[drop]] = float("-inf")
        probs = scores.softmax(-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=seq.generator or generator))
    return tokens
