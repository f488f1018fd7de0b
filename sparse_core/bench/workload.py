"""What the engine benchmarks run: the sparse policies' settings, random prompts, and
sequences that keep decoding while a step is measured."""

from __future__ import annotations

import random

from sparse_core.config import SparsityConfig
from sparse_core.engine.llm_engine import LLMEngine
from sparse_core.models.config import DUMMY_PRESETS
from sparse_core.models.loader import load_model_source
from sparse_core.policy import budgets_for_ratios, nearest_budget_profile
from sparse_core.sampling_params import SamplingParams

# Until aborted or max_model_len: no stop token ends them early.
KEEP_DECODING = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0.0)


def sparsity_for(
    policy: str, budget: int = 512, window: int = 32, full_layers: int = 3
) -> SparsityConfig:
    """The sparsity settings of the 4000-in / 500-out benchmarks (docs/benchmarks.md, "Setup")."""
    if policy == "dense":
        return SparsityConfig(policy="dense")
    return SparsityConfig(policy=policy, budget=budget, window=window, full_layers=full_layers)


def calibrated_shape(
    profile_model: str,
    target_compression: float,
    model: str,
    input_len: int,
    window: int = 32,
    sinks: int = 4,
) -> list[int | None]:
    """Per-layer budgets of `profile_model`'s calibrated profile for `target_compression`, laid
    onto `model`'s layers by relative depth and sized for `input_len`-token prompts: the memory
    and speed of that accuracy operating point on a model of another depth (a benchmark's
    random-weight model has no profile of its own)."""
    ratios = nearest_budget_profile(profile_model, target_compression).layer_ratios
    preset = DUMMY_PRESETS.get(model.removeprefix("dummy:")) if model.startswith("dummy:") else None
    num_layers = (preset or load_model_source(model).config).num_scored_layers
    resampled = [ratios[i * len(ratios) // num_layers] for i in range(num_layers)]
    return budgets_for_ratios(resampled, input_len, window + sinks + 1)


def random_prompt(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def bench_prompts(
    rng: random.Random, vocab_size: int, count: int, length: int, shared_prefix_len: int = 0
) -> list[list[int]]:
    """`count` random prompts of `length` tokens, the first `shared_prefix_len` of them the same
    in all (a document or system prompt that every request sends, then its own part)."""
    if not 0 <= shared_prefix_len <= length:
        raise ValueError(f"the shared prefix ({shared_prefix_len}) must fit the prompt ({length})")
    shared = random_prompt(rng, vocab_size, shared_prefix_len)
    return [
        shared + random_prompt(rng, vocab_size, length - shared_prefix_len) for _ in range(count)
    ]


def start_decoding(engine: LLMEngine, count: int, input_len: int, rng: random.Random) -> int:
    """Add `count` prompts of `input_len` random tokens that keep decoding, and step until each
    is admitted or a step admits none (the KV cache is full); returns how many are running."""
    vocab = engine.model_config.vocab_size
    for i in range(count):
        engine.add_request(f"running{i}", random_prompt(rng, vocab, input_len), KEEP_DECODING)
    scheduler = engine.scheduler
    while scheduler.waiting:
        admitted = len(scheduler.running)
        engine.step()
        if len(scheduler.running) <= admitted:
            break
    return len(scheduler.running)
