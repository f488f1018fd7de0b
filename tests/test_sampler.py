"""The batched sampler against the distributions it must draw from (temperature, top-k, top-p)."""

from __future__ import annotations

import pytest
import torch

from sparse_core import SamplingParams
from sparse_core.engine.sampler import _draw, sample
from sparse_core.sequence import Sequence

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAWS = 6000
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_CUDA])]


def _seqs(params: SamplingParams, count: int) -> list[Sequence]:
    return [Sequence(f"r{i}", [1], params, num_groups=1) for i in range(count)]


def _expected(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution written out the slow way: sort, cut, renormalise."""
    probs = (LOGITS / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    mass = probs[kept] / probs[kept].sum()
    covered, cut = 0.0, []
    for token, p in zip(kept, mass.tolist(), strict=True):
        if covered >= top_p:
            break
        cut.append(token)
        covered += p
    out = torch.zeros_like(probs)
    out[cut] = probs[cut] / probs[cut].sum()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (1.3, 5, 0.9)],
)
def test_draws_follow_the_filtered_distribution(temperature, top_k, top_p, device):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    generator = torch.Generator().manual_seed(0)
    logits = LOGITS.to(device).expand(DRAWS, -1)
    tokens = sample(logits, _seqs(params, DRAWS), generator, [True] * DRAWS)
    assert tokens.device == logits.device
    counts = torch.bincount(tokens.cpu(), minlength=len(LOGITS)).float()
    expected = _expected(temperature, top_k, top_p)
    assert (counts[expected == 0] == 0).all(), "a filtered-out token was drawn"
    total_variation = 0.5 * (counts / DRAWS - expected).abs().sum().item()
    assert total_variation < 0.03, (counts / DRAWS, expected)


def test_greedy_rows_take_the_argmax_and_unwanted_rows_draw_nothing():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    seqs = _seqs(SamplingParams(temperature=0), 2) + _seqs(SamplingParams(temperature=1.0), 2)
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    tokens = sample(logits, seqs, generator, [True, True, False, False])
    assert tokens[:2].tolist() == [int(logits[0].argmax()), int(logits[1].argmax())]
    assert torch.equal(generator.get_state(), state), "rows that were not wanted drew numbers"


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def seeded_token(row: int, others: list[SamplingParams]) -> int:
        params = [*others[:row], seeded, *others[row:]]
        seqs = [Sequence(f"r{i}", [1], p, num_groups=1) for i, p in enumerate(params)]
        batch = torch.cat([logits[1 : 1 + row], logits[:1], logits[1 + row : len(params)]])
        return int(sample(batch, seqs, torch.Generator(), [True] * len(params))[row])

    alone = seeded_token(0, [])
    mixed = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0),
        SamplingParams(top_k=4),
    ]
    assert seeded_token(0, mixed) == seeded_token(2, mixed) == seeded_token(3, mixed) == alone


@pytest.mark.parametrize("device", DEVICES)
def test_a_threshold_at_the_total_mass_stays_on_a_token_that_has_any(device):
    """Rounding can make the uniform's share equal the kept mass; the draw must not then land
    on a token that was cut (or that has underflowed to zero)."""
    logits = torch.tensor(
        [[3.0, 2.0, 1.0, -200.0, -200.0], [-200.0, 3.0, 2.0, -200.0, -200.0]], device=device
    )
    ones = torch.ones(2, device=device)
    assert _draw(logits, ones, None, None, uniforms=ones).tolist() == [2, 2]
    top_p = torch.tensor([0.5, 0.5], device=device)
    assert _draw(logits, ones, top_p, None, uniforms=ones).tolist() == [0, 1]
    top_k = torch.tensor([2, 0], device=device)
    assert _draw(logits, ones, None, top_k, uniforms=ones).tolist() == [1, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_a_plain_seeded_row_ignores_the_filters_of_its_neighbours(device):
    """A row without top-k or top-p draws the same token alone and next to rows that filter."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(3)).to(device)
    neighbours = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(top_k=5)]
    for seed in range(20):
        plain = SamplingParams(temperature=1.0, seed=seed)
        alone = sample(logits[:1], _seqs(plain, 1), torch.Generator(), [True])
        seqs = _seqs(plain, 1) + [Sequence(f"n{i}", [1], p, 1) for i, p in enumerate(neighbours)]
        mixed = sample(logits, seqs, torch.Generator(), [True] * 3)
        assert int(alone[0]) == int(mixed[0]), seed


def test_a_tiny_temperature_is_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=1e-7)
    assert params.greedy
    assert sample(logits, _seqs(params, 1), torch.Generator(), [True]).tolist() == [1]
    # Just above the greedy threshold the draw stays finite and on the top token.
    ones = torch.ones(1)
    assert _draw(logits * 1e6, ones * 2e-5, None, None, uniforms=ones * 0.5).tolist() == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token(device):
    """1e-300 is 0 in float32: the most likely token still stays, never the vocabulary's last."""
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0]], device=device).expand(50, -1)
    params = SamplingParams(temperature=1.0, top_p=1e-300)
    tokens = sample(logits, _seqs(params, 50), torch.Generator().manual_seed(0), [True] * 50)
    assert tokens.tolist() == [1] * 50
