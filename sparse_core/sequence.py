"""A request inside the engine: its tokens, its blocks in every layer group, its state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from sparse_core.cache.retention import DecodeRing
from sparse_core.outputs import TokenLogprobs
from sparse_core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_groups: int
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # Per layer group: the blocks holding this sequence's KV and how many tokens they hold.
    block_tables: list[list[int]] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)
    # Per layer group, while a prefill that caches runs (BlockManager): the blocks its kept
    # tokens go to in a compressing group, else None.
    kept_tables: list[list[int] | None] = field(default_factory=list)
    caches_prefill: bool = False
    # Hashes of the first full blocks of token_ids (prefix caching), extended as needed.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # The most prompt tokens an admission found in the prefix cache.
    num_cached_tokens: int = 0
    # Per layer group: tokens kept for the whole prompt (its compression): those kept by the
    # prefill, plus any prompt tokens fed one per step after a compressed prefix.
    prompt_kv_lens: list[int] = field(default_factory=list)
    # Per layer group: the tokens its cache held when the sequence finished (kv_lens then).
    final_kv_lens: list[int] = field(default_factory=list)
    # Per layer group, from the last admission: where the tokens fed after the prefill go
    # (GroupRetention.decode_ring).
    decode_rings: list[DecodeRing] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens fed through the model since the last (re)prefill
    num_scheduled_tokens: int = 0  # tokens the current step feeds: a prefill (chunk), or one
    prefill_len: int = 0  # num_prefill_tokens when last admitted: what its (re)prefill feeds
    table_row: int = -1  # this sequence's row in the block manager's host block tables
    num_preemptions: int = 0
    # In a step that failed, and not yet in one of its own that succeeded: the scheduler runs
    # such sequences one at a time, to find the one that fails (Scheduler.preempt_after_failure).
    suspect: bool = False
    num_failed_steps: int = 0
    first_token_time: float | None = None
    generator: torch.Generator | None = None
    text: str = ""  # detokenised output, stop strings removed
    # One per output token, when the request asks for logprobs (`SamplingParams.logprobs`).
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset_cache_state()
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def reset_cache_state(self) -> None:
        self.block_tables = [[] for _ in range(self.num_groups)]
        self.kv_lens = [0] * self.num_groups
        self.decode_rings = [DecodeRing(0, 0)] * self.num_groups
        self.kept_tables = [None] * self.num_groups
        self.caches_prefill = False
        self.table_row = -1
        self.num_computed_tokens = 0
        self.prefill_len = 0

    def start_prefill(self, num_cached: int) -> None:
        """Admitted (BlockManager.allocate gave its blocks): a (re)prefill of
        `num_prefill_tokens` starts after the `num_cached` tokens found in the prefix cache."""
        self.prefill_len = self.num_prefill_tokens
        self.num_computed_tokens = num_cached
        self.num_cached_tokens = max(self.num_cached_tokens, num_cached)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens a prefill feeds: all known ones, or only the prompt's compressed prefix (the
        rest, prompt and any outputs being recomputed, then goes one per decode step)."""
        prefix = self.params.compress_prefix_len
        return len(self) if prefix is None else prefix

    @property
    def num_forced_prompt_tokens(self) -> int:
        """Prompt tokens fed by decode steps after the prefill (0 without compress_prefix_len)."""
        return max(0, len(self.prompt_token_ids) - self.num_prefill_tokens)

    @property
    def is_prefilling(self) -> bool:
        """Whether its prefill (its compressed prefix, when one is set) is not done yet."""
        return self.num_computed_tokens < self.prefill_len

    @property
    def samples_next_token(self) -> bool:
        """Whether the current step ends at the last known token, so that what it samples is
        the next output token (and not a forced token's or a prompt chunk's discarded
        prediction); so does a step fed the token in flight (`input_in_flight`)."""
        return self.num_computed_tokens + self.num_scheduled_tokens >= len(self)

    @property
    def input_in_flight(self) -> bool:
        """Whether the token a decode step feeds next is the one a step still in flight samples
        (async scheduling): not among its tokens on the host yet."""
        return self.num_computed_tokens == len(self)

    @property
    def next_input_token_id(self) -> int:
        """The token a decode step feeds: the first one not yet computed."""
        i, num_prompt = self.num_computed_tokens, len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < num_prompt else self.output_token_ids[i - num_prompt]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
