"""Next-token choice for a batch, on the logits' device: `logit_bias`, penalties and
`min_tokens` bans applied to the logits first (in that order, as vLLM applies them), then
greedy rows by argmax, the rest drawn from their temperature-scaled distribution after top-k
and top-p, by inverse CDF.

Every sampled row draws one uniform number on the host, from its sequence's own generator when
the request has a `seed` (so its output does not depend on what else is in the batch) and from
the engine's otherwise. The rest is a few batched ops on the device, whose result stays there
until the engine asks for it: copying each row of a large vocabulary to the host to sample it
there costs many decode steps' time (docs/benchmarks.md, "Engine internals").

Logprobs (`SamplingParams.logprobs`) are those of the model's raw output: the log-softmax of the
logits in float32, before `logit_bias`, penalties, `min_tokens` bans, temperature, top-k and
top-p, as vLLM returns them by default (`logprobs_mode="raw_logprobs"`). `sampled_logprobs`
computes them on the device, batched over the rows that ask (a step with none does nothing
more).
"""

from __future__ import annotations

import torch

from sparse_core.sequence import Sequence
from sparse_core.transfers import SampledLogprobs, to_device


def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    generator: torch.Generator,
    wanted: list[bool],
    next_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] float32 -> one token id per sequence, int64 [B] on the logits' device.

    Rows that are not wanted (a forced prompt token's or an early chunk's prediction) draw
    nothing, so a split prompt samples like a whole one; their ids are the argmax, to be
    ignored. `next_ids`: the device token pool (DeviceTokens.next_ids), needed when a row's
    input is in flight (`Sequence.input_in_flight`, a step launched ahead): that token, not in
    its sequence's outputs yet, is read there, and penalties and `min_tokens` count it.
    """
    logits = _adjusted(logits, seqs, wanted, next_ids)
    tokens = logits.argmax(dim=-1)
    rows = [r for r, seq in enumerate(seqs) if wanted[r] and not seq.params.greedy]
    if rows:
        params = [seqs[r].params for r in rows]
        uniforms = [float(torch.rand(1, generator=seqs[r].generator or generator)) for r in rows]
        device = logits.device
        settings = to_device(
            [[p.temperature for p in params], [p.top_p for p in params], uniforms],
            torch.float32,
            device,
        )
        top_k = [p.top_k for p in params]
        index = to_device(rows, torch.int64, device)
        tokens[index] = _draw(
            logits[index],
            temperature=settings[0],
            top_p=settings[1] if any(p.top_p < 1 for p in params) else None,
            top_k=to_device(top_k, torch.int64, device) if any(top_k) else None,
            uniforms=settings[2],
        )
    return tokens


def sampled_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence], wanted: list[bool]
) -> SampledLogprobs | None:
    """The logprobs of the sampled `tokens` [B] and of the most likely tokens, for the wanted
    rows that ask for them, from the raw `logits` [B, V]; None (and no work) when none asks."""
    rows = [r for r, seq in enumerate(seqs) if wanted[r] and seq.params.logprobs is not None]
    if not rows:
        return None
    num_top = [seqs[r].params.logprobs or 0 for r in rows]
    index = to_device(rows, torch.int64, logits.device)
    logprobs = logits[index].float().log_softmax(dim=-1)
    top = logprobs.topk(max(num_top), dim=-1)
    values = torch.cat([logprobs.gather(1, tokens[index, None]), top.values], dim=1)
    return SampledLogprobs(rows, num_top, values, top.indices)


def _adjusted(
    logits: torch.Tensor,
    seqs: list[Sequence],
    wanted: list[bool],
    next_ids: torch.Tensor | None,
) -> torch.Tensor:
    """The logits with `logit_bias` added, penalties applied and tokens banned by `min_tokens`
    at -inf (a copy, only when some row has any; rows without are untouched)."""

    def num_outputs(row: int) -> int:
        return len(seqs[row].output_token_ids) + seqs[row].input_in_flight

    banned = [
        (row, token)
        for row, seq in enumerate(seqs)
        if wanted[row] and num_outputs(row) < seq.params.min_tokens
        for token in seq.params.banned_until_min_tokens()
    ]
    biased = [
        (row, token, bias)
        for row, seq in enumerate(seqs)
        if wanted[row] and seq.params.logit_bias
        for token, bias in seq.params.logit_bias.items()
    ]
    rows = [r for r, seq in enumerate(seqs) if wanted[r] and seq.params.penalizes]
    if not banned and not rows and not biased:
        return logits
    logits = logits.clone()
    device, vocab = logits.device, logits.shape[-1]
    if biased:
        at = to_device([[row, token] for row, token, _ in biased], torch.int64, device)
        logits[at[:, 0], at[:, 1]] += to_device([b for _, _, b in biased], logits.dtype, device)
    if rows:
        index = to_device(rows, torch.int64, device)
        outputs = _padded([seqs[r].output_token_ids for r in rows], vocab, device)
        in_flight = [seqs[r].input_in_flight for r in rows]
        if any(in_flight):
            assert next_ids is not None, "a row's input is in flight: the token pool is needed"
            newest = next_ids[to_device([seqs[r].table_row for r in rows], torch.int64, device)]
            is_pending = to_device(in_flight, torch.bool, device)
            outputs = torch.cat([outputs, torch.where(is_pending, newest, vocab)[:, None]], dim=1)
        counts = _histogram(outputs, vocab)
        in_prompt = _histogram(_padded([seqs[r].prompt_token_ids for r in rows], vocab, device),
                               vocab) > 0  # fmt: skip
        params = [seqs[r].params for r in rows]
        settings = to_device(
            [
                [p.repetition_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            ],
            torch.float32,
            device,
        )[:, :, None]
        scores = logits[index]
        repeated = torch.where(scores > 0, scores / settings[0], scores * settings[0])
        scores = torch.where(in_prompt | (counts > 0), repeated, scores)
        scores -= settings[2] * counts + settings[1] * (counts > 0)
        logits[index] = scores
    if banned:
        at = to_device(banned, torch.int64, device)
        logits[at[:, 0], at[:, 1]] = float("-inf")
    return logits


def _padded(ids: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """int64 [R, longest] on the device, short rows filled with `pad`."""
    longest = max(map(len, ids))
    return to_device([row + [pad] * (longest - len(row)) for row in ids], torch.int64, device)


def _histogram(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [R, vocab]: occurrences of each id per row (ids equal to `vocab` are padding)."""
    counts = torch.zeros(ids.shape[0], vocab + 1, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :vocab]


def _draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token per row of logits [R, V]: the first, in vocabulary order, whose cumulative
    probability exceeds the row's uniform share of the kept mass. Every row walks the same order,
    filtered or not, so a row's token does not depend on whether other rows filter theirs."""
    # Shifted by the row's maximum first, so that a small temperature gives -inf, never NaN.
    scores = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None]
    probs = scores.softmax(dim=-1)
    if top_k is not None or top_p is not None:
        probs = probs.masked_fill(~_kept(scores, top_p, top_k), 0.0)
    cdf = probs.cumsum(dim=-1)
    choice = (cdf <= (uniforms * cdf[:, -1])[:, None]).sum(dim=-1)
    # Rounding can put the threshold at the total mass: stay on the last token that has any.
    last_kept = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(choice, last_kept)


def _kept(
    scores: torch.Tensor, top_p: torch.Tensor | None, top_k: torch.Tensor | None
) -> torch.Tensor:
    """bool [R, V]: top_k [R] (0 = off) keeps the k highest scores (exactly k: ties go by sort
    order); top_p [R] then keeps the fewest most likely of those whose renormalised mass reaches
    top_p (the most likely always stays; 1 keeps all)."""
    ranked, order = scores.sort(dim=-1, descending=True)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if top_k is not None:
        rank = torch.arange(ranked.shape[-1], device=ranked.device)
        keep &= (top_k[:, None] == 0) | (rank[None, :] < top_k[:, None])
    if top_p is not None:
        probs = ranked.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p.
        above = probs.cumsum(dim=-1) - probs
        keep &= (above < top_p[:, None]) | (top_p[:, None] >= 1)
        keep[:, 0] = True  # the most likely, even for a top_p that float32 rounds to 0
    return torch.empty_like(keep).scatter_(-1, order, keep)
