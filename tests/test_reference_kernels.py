"""The plain-torch kernels against direct computations that materialise everything."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparse_core.kernels import reference as ref


def full_attention_probs(q, k, scale):
    """Softmax matrix [Hq, n, n] of one causal sequence, GQA by repeating KV heads."""
    group = q.shape[1] // k.shape[1]
    qs = q.transpose(0, 1).double()
    ks = k.transpose(0, 1).double().repeat_interleave(group, dim=0)
    logits = qs @ ks.transpose(1, 2) * scale
    n = q.shape[0]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    return logits.masked_fill(~mask, float("-inf")).softmax(-1)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("n", [37, 101])
def test_window_scores_and_selection_match_the_full_softmax(group, n):
    torch.manual_seed(group * 1000 + n)
    num_kv, head_dim, window, sinks, budget = 2, 16, 8, 3, 24
    q = torch.randn(n, num_kv * group, head_dim)
    k = torch.randn(n, num_kv, head_dim)
    v = torch.randn(n, num_kv, head_dim)
    scale = head_dim**-0.5

    _, lse = ref.prefill_attention(q, k, v, torch.tensor([0, n]), scale)
    scores = ref.window_scores(q[n - window :], k, lse[:, n - window :], scale)

    probs = full_attention_probs(q, k, scale)  # [Hq, n, n]
    direct = probs[:, n - window :, : n - window].sum(dim=1)  # attention received from the window
    direct = direct.view(num_kv, group, n - window).mean(dim=1)
    torch.testing.assert_close(scores.double(), direct, rtol=1e-4, atol=1e-6)

    # The window LSE computed without the attention kernel agrees as well.
    torch.testing.assert_close(ref.window_lse(q[n - window :], k, scale), lse[:, n - window :])

    kept = ref.select_top_tokens(ref.pool_scores(scores, "none", 1), n, budget, window, sinks)
    for h in range(num_kv):
        middle = direct[h, sinks:].argsort(descending=True)[: budget - window - sinks] + sinks
        expected = sorted([*range(sinks), *middle.tolist(), *range(n - window, n)])
        assert kept[h].tolist() == expected


def test_prefill_attention_matches_sdpa_on_packed_sequences():
    torch.manual_seed(0)
    lens = [5, 33, 18]
    cu = torch.tensor([0, 5, 38, 56])
    q, k, v = torch.randn(56, 4, 8), torch.randn(56, 2, 8), torch.randn(56, 2, 8)
    out, lse = ref.prefill_attention(q, k, v, cu, 0.3)
    torch.testing.assert_close(out, ref.causal_attention(q, k, v, cu, 0.3), rtol=1e-4, atol=1e-5)
    start = 0
    for n in lens:
        qs, ks = q[start : start + n], k[start : start + n]
        logits = qs.transpose(0, 1) @ ks.transpose(0, 1).repeat_interleave(2, 0).transpose(1, 2)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        expected = torch.logsumexp((logits * 0.3).masked_fill(~causal, float("-inf")), dim=-1)
        torch.testing.assert_close(lse[:, start : start + n], expected)
        start += n


def test_a_chunk_after_cached_keys_attends_like_the_whole_sequence():
    """Queries that are a sequence's last tokens, with all its keys: the rows of the whole
    sequence's causal attention, through both the oracle and the SDPA path."""
    torch.manual_seed(1)
    # Two sequences of 40 and 23 tokens; the queries are the first's last 15, the second's all.
    cu = torch.tensor([0, 40, 63])
    q, k, v = torch.randn(63, 4, 8), torch.randn(63, 2, 8), torch.randn(63, 2, 8)
    whole_out, whole_lse = ref.prefill_attention(q, k, v, cu, 0.3)
    rows = torch.cat([torch.arange(25, 40), torch.arange(40, 63)])
    cu_q = torch.tensor([0, 15, 38])
    out, lse = ref.prefill_attention(q[rows], k, v, cu_q, 0.3, cu_seqlens_k=cu)
    torch.testing.assert_close(out, whole_out[rows])
    torch.testing.assert_close(lse, whole_lse[:, rows])
    sdpa = ref.causal_attention(q[rows], k, v, cu_q, 0.3, cu_seqlens_k=cu)
    torch.testing.assert_close(sdpa, whole_out[rows], rtol=1e-4, atol=1e-5)


def test_pooling_keeps_length_and_smooths():
    scores = torch.zeros(2, 11)
    scores[:, 5] = 7.0
    avg = ref.pool_scores(scores, "avg", 3)
    mx = ref.pool_scores(scores, "max", 3)
    assert avg.shape == mx.shape == scores.shape
    assert avg[0, 4:7].tolist() == pytest.approx([7 / 3] * 3)
    assert mx[0].tolist() == [0, 0, 0, 0, 7, 7, 7, 0, 0, 0, 0]


def test_gather_takes_a_different_token_per_head():
    x = torch.arange(5 * 2 * 3, dtype=torch.float32).view(5, 2, 3)
    idx = torch.tensor([[0, 4], [1, 2]])
    out = ref.gather_tokens(x, idx)
    assert torch.equal(out[0, 0], x[0, 0]) and torch.equal(out[1, 0], x[4, 0])
    assert torch.equal(out[0, 1], x[1, 1]) and torch.equal(out[1, 1], x[2, 1])


def test_paged_decode_matches_dense_attention_with_shuffled_blocks():
    torch.manual_seed(1)
    block_size, num_blocks, num_kv, group, head_dim = 4, 20, 2, 3, 8
    k_cache = torch.randn(num_blocks, block_size, num_kv, head_dim)
    v_cache = torch.randn(num_blocks, block_size, num_kv, head_dim)
    perm = torch.randperm(num_blocks)
    tables = torch.stack([perm[:5], perm[5:10]])
    lens = torch.tensor([17, 6])
    q = torch.randn(2, num_kv * group, head_dim)
    out = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.5)
    for b in range(2):
        keys = k_cache[tables[b]].flatten(0, 1)[: lens[b]]
        values = v_cache[tables[b]].flatten(0, 1)[: lens[b]]
        expected = F.scaled_dot_product_attention(
            q[b].unsqueeze(1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            scale=0.5,
            enable_gqa=True,
        ).squeeze(1)
        torch.testing.assert_close(out[b], expected, rtol=1e-4, atol=1e-5)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(3, 2, 1, 2)
    v_cache = torch.zeros(3, 2, 1, 2)
    k = torch.ones(3, 1, 2)
    ref.store_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(6, 1, 2)[5].sum() == 2 and k_cache.view(6, 1, 2)[0].sum() == 2
    assert k_cache.sum() == 4 and v_cache.sum() == 8
