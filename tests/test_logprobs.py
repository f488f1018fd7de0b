"""Logprobs (`SamplingParams.logprobs`): the float32 log-softmax of the raw logits (before
penalties, temperature, top-k and top-p, as vLLM's default `raw_logprobs`), for the rows that
ask, the sampled token's included. On the real model (its weights as loaded, and in FP8): the
log-softmax, in plain torch, of the logits each step sampled from, and for the unquantized
model of the logits Hugging Face's implementation computes for the same tokens.

With FP8 weights an independent implementation is no reference: activations are quantized per
token to 3 mantissa bits, so float differences of 1e-7 flip roundings, which move logprobs by
a few hundredths (as batching the same prompt differently does)."""

from __future__ import annotations

import pytest
import torch

from sparse_core import LLM, SamplingParams
from sparse_core.engine import model_runner
from sparse_core.engine.sampler import sample, sampled_logprobs
from sparse_core.outputs import RequestOutput, TokenLogprobs
from sparse_core.sequence import Sequence
from sparse_core.transfers import PendingTokens

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_CUDA])]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# Greedy and sampled, with penalties (which the logprobs do not see).
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, logprobs=5,
                   ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1, presence_penalty=0.8,
                   frequency_penalty=0.5, logprobs=3, ignore_eos=True),
]  # fmt: skip


def _read(
    logits: torch.Tensor, seqs: list[Sequence], wanted: list[bool]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample a step's rows and read back their tokens and logprobs, as the engine does."""
    tokens = sample(logits, seqs, torch.Generator().manual_seed(0), wanted)
    pending = PendingTokens(tokens, sampled_logprobs(logits, tokens, seqs, wanted))
    return pending.tolist(), pending.logprobs()


def _check(entry: TokenLogprobs, token: int, reference: torch.Tensor, k: int, atol: float):
    """`entry` is token's logprob in `reference` (one position's log-softmax) and the k most
    likely's, most likely first (compared by value: near ties may swap between two
    implementations)."""
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(reference[token].item(), abs=atol)
    ids = [t for t, _ in entry.top]
    values = [v for _, v in entry.top]
    assert len(ids) == len(set(ids)) == k
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(reference.topk(k).values.tolist(), abs=atol)
    assert values == pytest.approx(reference[ids].tolist(), abs=atol)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_the_raw_log_softmax_of_the_rows_that_ask(device):
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 4
    logits[1, 7] = logits[1].max() + 1.0  # the favourite, unless penalized: it was generated
    logits = logits.to(device)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0, presence_penalty=2.0, logprobs=1),
        SamplingParams(temperature=2.0, top_k=50, logprobs=0),
        SamplingParams(temperature=1.0, seed=3, frequency_penalty=1.0, logprobs=20),
        SamplingParams(temperature=0),  # does not ask
        SamplingParams(temperature=0.8, logprobs=2),  # a row whose sample is not wanted
    ]
    seqs = [Sequence(f"r{i}", [1, 2], p, num_groups=1) for i, p in enumerate(params)]
    for seq in seqs:
        seq.output_token_ids = [7, 9]
    tokens, logprobs = _read(logits, seqs, [True] * 5 + [False])
    reference = torch.log_softmax(logits.cpu().float(), dim=-1)
    for row in range(4):
        _check(logprobs[row], tokens[row], reference[row], params[row].logprobs, atol=1e-6)
    assert logprobs[4] is None and logprobs[5] is None
    assert tokens[0] == int(reference[0].argmax())
    # The penalized greedy row chose another token than the raw favourite, which is its top 1:
    # its own logprob comes all the same.
    assert tokens[1] != 7 and logprobs[1].top[0][0] == 7
    assert logprobs[1].logprob < logprobs[1].top[0][1]


def test_a_step_where_no_row_asks_computes_nothing():
    logits = torch.randn(3, 50)
    seqs = [
        Sequence(f"r{i}", [1], SamplingParams(temperature=t), 1) for i, t in enumerate([0, 1, 0])
    ]
    tokens = sample(logits, seqs, torch.Generator(), [True] * 3)
    assert sampled_logprobs(logits, tokens, seqs, [True] * 3) is None
    assert PendingTokens(tokens).logprobs() == [None] * 3


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "2"])
def test_out_of_range_or_wrong_type_is_refused(value):
    with pytest.raises(ValueError, match=r"^logprobs"):
        SamplingParams(logprobs=value)


def _check_outputs(outputs: list[RequestOutput], references: list[torch.Tensor], atol: float):
    """Every output's logprobs against the log-softmax of its positions' logits [T, V]."""
    for out, params, reference in zip(outputs, PARAMS, references, strict=True):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 12
        for entry, token, at in zip(out.logprobs, out.token_ids, reference, strict=True):
            _check(entry, token, at, params.logprobs, atol)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_real_models_logprobs_are_the_log_softmax_of_what_it_sampled_from(
    quantization, monkeypatch
):
    """Two requests decoding side by side after a batched prefill: each token's logprobs are
    those of its own row of its step's logits."""
    steps = []
    real = model_runner.sampled_logprobs

    def recording(logits, tokens, seqs, wanted):
        steps.append((logits.clone(), [s.request_id for s in seqs], list(wanted)))
        return real(logits, tokens, seqs, wanted)

    monkeypatch.setattr(model_runner, "sampled_logprobs", recording)
    with LLM(max_model_len=256, quantization=quantization) as llm:
        outputs = llm.generate(PROMPTS, PARAMS)
    rows: dict[str, list[torch.Tensor]] = {out.request_id: [] for out in outputs}
    for logits, request_ids, wanted in steps:
        for row, (request_id, sampled) in enumerate(zip(request_ids, wanted, strict=True)):
            if sampled:
                rows[request_id].append(torch.log_softmax(logits[row].float(), dim=-1))
    _check_outputs(outputs, [torch.stack(rows[out.request_id]) for out in outputs], atol=1e-6)


def test_the_real_models_logprobs_match_transformers(dense_llm, hf_model):
    """Against Hugging Face's logits for the prompt and the generated tokens (teacher forced)."""
    outputs = dense_llm.generate(PROMPTS, PARAMS)
    references = []
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            logits = hf_model(ids).logits[0].float()
        start = len(out.prompt_token_ids) - 1
        references.append(torch.log_softmax(logits[start : start + len(out.token_ids)], dim=-1))
    _check_outputs(outputs, references, atol=2e-4)
    assert dense_llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))[0].logprobs is None
