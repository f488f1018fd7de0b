"""The prefix cache's hit rate on the chat load of docs/benchmarks.md ("Served as users compare
it"), at the pool sizes of the Llama-3-8B shape under the 24 GB cap, driven through the block
manager alone: what the eviction rule decides, without a GPU.

The model is lockstep: each turn, every conversation of a wave is admitted and prefilled in
turn, then each decodes its 200 tokens, then all end. The server's order differs (a conversation
comes back as soon as its answer ends), so these rates are not the server's; they separate the
rules. Measured on an H100 after a unique-prompt load on the same server: plain LRU cached 69%
at 32 conversations and 0% at 64; a rule that cached a new prefix only into blocks that never held
one, 32.9% and 2.0%. In this model, with a pool per layer group sized for unique prompts, those
two gave 62.9% / 0.0% and 43.3% / 23.7%, and the expiry rule (BlockPool) 60.7% / 24.6%; with one
pool every group shares (KVRetention), the expiry rule gives 68.4% / 56.7%: a cached prefix's
sparse layers no longer wait for room in a pool sized for kept tokens. The tests below fail for
either earlier rule, and for separate pools.
"""

from __future__ import annotations

import random

import pytest
import torch

from sparse_core.cache.block_manager import BlockManager
from sparse_core.cache.retention import KVRetention
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.models.config import DUMMY_PRESETS
from sparse_core.sampling_params import SamplingParams
from sparse_core.sequence import Sequence

# The chart's engine on the 8B shape: FP8 KV in 128-token blocks, about 11 GiB of it under the
# 24 GB cap, snapkv with budget 512, window 32 and the first 3 layers whole.
CONFIG = EngineConfig(block_size=128, kv_cache_dtype="fp8", max_model_len=8192)
SPARSITY = SparsityConfig(policy="snapkv", budget=512, window=32, sinks=4, full_layers=3)
KV_BYTES = 11 * 2**30
CONVERSATIONS, TURNS, FIRST_TURN, PER_TURN, ANSWER = 64, 4, 2100, 300, 200


def engine_blocks() -> BlockManager:
    retention = KVRetention.build(DUMMY_PRESETS["llama3-8b"], CONFIG, SPARSITY, torch.bfloat16)
    return BlockManager(retention, retention.num_blocks(KV_BYTES), max_num_seqs=256, max_model_len=8192,
                        enable_prefix_caching=True, min_uncached_tokens=SPARSITY.window)  # fmt: skip


def serve(bm: BlockManager, prompts: list[list[int]], output_len: int) -> int:
    """Admit and prefill every prompt, decode each `output_len` tokens, end them all; returns
    the prompt tokens found cached."""
    running = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(str(i), prompt, SamplingParams(), len(bm.groups))
        assert bm.admission(seq).fits
        seq.start_prefill(bm.allocate(bm.admission(seq)))
        seq.num_computed_tokens = seq.prefill_len
        bm.end_prefill(seq)
        running.append(seq)
    for seq in running:
        for _ in range(output_len):
            assert bm.can_append(seq)
            bm.append_slot(seq)
    for seq in running:
        bm.free(seq)
    bm.check_invariants([])
    return sum(seq.num_cached_tokens for seq in running)


def chats(bm: BlockManager, at_once: int, rng: random.Random) -> float:
    """The share of prompt tokens found cached over 64 four-turn chats, `at_once` at a time."""
    asked = found = 0
    for _ in range(CONVERSATIONS // at_once):
        history = [rng.choices(range(1, 120_000), k=FIRST_TURN) for _ in range(at_once)]
        for _ in range(TURNS):
            found += serve(bm, history, ANSWER)
            asked += sum(map(len, history))
            # The next turn: the answer and a new question.
            history = [h + rng.choices(range(1, 120_000), k=PER_TURN) for h in history]
    return found / asked


@pytest.fixture(scope="module")
def hit_rates() -> dict[int, float]:
    """After a load of unique 4000/500 prompts (64 at once, two rounds), chats at 32 then 64 at
    once on the same pools, as the benchmark runs them."""
    bm, rng = engine_blocks(), random.Random(0)
    for _ in range(2):
        serve(bm, [rng.choices(range(1, 120_000), k=4000) for _ in range(64)], 500)
    return {at_once: chats(bm, at_once, rng) for at_once in (32, 64)}


def test_chats_that_fit_keep_the_hits_of_lru(hit_rates):
    # A turn finds the previous prompt's full blocks: at most 7,040 of 10,200 tokens (69.0%).
    assert hit_rates[32] >= 0.65, hit_rates


def test_more_chats_than_the_cache_holds_keep_the_first_ones_hitting(hit_rates):
    # Most of the 64 conversations' prefixes fit beside the running sequences' kept tokens.
    assert hit_rates[64] >= 0.50, hit_rates
