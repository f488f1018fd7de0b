"""Logit bias, penalties and min_tokens in the batched sampler, against vLLM's formulas written
out per row."""

from __future__ import annotations

import pytest
import torch

from sparse_core import SamplingParams
from sparse_core.engine.sampler import sample
from sparse_core.sequence import Sequence

VOCAB = 12


def _seq(params: SamplingParams, prompt: list[int], outputs: list[int]) -> Sequence:
    seq = Sequence("r", prompt, params, num_groups=1)
    seq.output_token_ids = list(outputs)
    return seq


def _reference(logits: torch.Tensor, params: SamplingParams, prompt, outputs) -> torch.Tensor:
    """vLLM's order: repetition penalty on prompt and output tokens, then frequency and
    presence penalties on output tokens."""
    out = logits.clone()
    for token in set(prompt) | set(outputs):
        rep = params.repetition_penalty
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token in set(outputs):
        out[token] -= params.frequency_penalty * outputs.count(token) + params.presence_penalty
    return out


CASES = [
    SamplingParams(temperature=0, repetition_penalty=1.3),
    SamplingParams(temperature=0, presence_penalty=1.5),
    SamplingParams(temperature=0, frequency_penalty=0.7),
    SamplingParams(temperature=0, repetition_penalty=0.8, presence_penalty=-0.5,
                   frequency_penalty=0.4),
]  # fmt: skip


def test_greedy_rows_take_the_argmax_of_the_penalized_logits():
    generator = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3], [4, 4], [5], [0, 6, 7, 8]]
    outputs = [[2, 2, 9], [4, 10], [11, 11, 11], [8, 1]]
    for trial in range(20):
        logits = torch.randn(len(CASES) + 1, VOCAB, generator=generator) * 3
        seqs = [_seq(p, pr, o) for p, pr, o in zip(CASES, prompts, outputs, strict=True)]
        seqs.append(_seq(SamplingParams(temperature=0), [1], [2]))  # no penalty: untouched
        tokens = sample(logits, seqs, generator, [True] * len(seqs)).tolist()
        expected = [
            int(_reference(logits[r], CASES[r], prompts[r], outputs[r]).argmax())
            for r in range(len(CASES))
        ]
        assert tokens == [*expected, int(logits[-1].argmax())], trial


def test_a_launched_ahead_rows_token_in_flight_counts_as_an_output():
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 1.0  # the favourite, unless it was just generated
    seqs = [_seq(params, [0], []), _seq(params, [0], [])]
    for row, seq in enumerate(seqs):
        seq.table_row = 1 - row
    # The last row's input is the token its previous step sampled, not on the host yet: 3, in
    # its entry (1 - 1 = 0) of the device token pool; the first row's entry holds a stale 3.
    seqs[1].num_computed_tokens = len(seqs[1])
    next_ids = torch.tensor([3, 3])
    first, last = sample(logits, seqs, torch.Generator(), [True, True], next_ids).tolist()
    assert first == 3 and last != 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_and_stop_ids_until_reached(temperature):
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[5],
                            eos_token_ids=[7])  # fmt: skip
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 5] = logits[0, 7] = 10.0  # stopping is all but certain
    generator = torch.Generator().manual_seed(0)
    for generated in range(5):
        token = sample(logits, [_seq(params, [1], [0] * generated)], generator, [True]).item()
        assert (token in (5, 7)) == (generated >= 3), generated
    ignoring = SamplingParams(min_tokens=3, eos_token_ids=[7], ignore_eos=True)
    assert ignoring.banned_until_min_tokens() == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
     ("min_tokens", 17), ("seed", 2**63)],
)  # fmt: skip
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})


def test_logit_bias_is_added_before_the_penalties_for_greedy_rows():
    """Each row's argmax is that of its logits plus its bias, then penalized (vLLM's order: a
    repetition penalty divides a biased positive logit); rows without a bias are untouched."""
    generator = torch.Generator().manual_seed(1)
    prompt, outputs = [1, 2], [3, 3]
    for trial in range(20):
        logits = torch.randn(3, VOCAB, generator=generator) * 3
        tokens = torch.randperm(VOCAB, generator=generator)[:4].tolist()
        values = (torch.randn(4, generator=generator) * 4).tolist()
        bias = dict(zip(tokens, values, strict=True))
        cases = [
            SamplingParams(temperature=0, logit_bias=bias),
            SamplingParams(temperature=0, logit_bias=bias, repetition_penalty=1.5,
                           frequency_penalty=0.5),
            SamplingParams(temperature=0),
        ]  # fmt: skip
        seqs = [_seq(p, prompt, outputs) for p in cases]
        chosen = sample(logits, seqs, generator, [True] * 3).tolist()
        biased = logits.clone()
        for token, value in bias.items():
            biased[:2, token] += value
        expected = [int(_reference(biased[r], cases[r], prompt, outputs).argmax()) for r in (0, 1)]
        assert chosen == [*expected, int(logits[2].argmax())], trial


def test_a_logit_bias_of_100_forces_and_of_minus_100_bans_sampled_tokens():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, VOCAB, generator=generator)
    favourite = int(logits[1].argmax())
    params = [
        SamplingParams(temperature=1.0, logit_bias={7: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={favourite: -100.0}),
    ]
    seqs = [_seq(p, [1], []) for p in params]
    drawn = [sample(logits, seqs, generator, [True, True]).tolist() for _ in range(200)]
    assert all(first == 7 for first, _ in drawn)
    assert all(second != favourite for _, second in drawn)
    assert len({second for _, second in drawn}) > 3  # still a draw, not a fixed choice
