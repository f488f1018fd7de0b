"""Continuous batching: every step feeds one token to each running sequence (a generated one, or
a prompt token fed after a compressed prefix) and, in the same forward pass, prefills the prompts
admitted for it, up to max_num_batched_tokens prompt tokens. With chunked prefill a prompt that
does not fit what is left of a step goes in chunks over several steps; without, a prompt longer
than a step runs alone in one. A prompt is admitted only
when every layer group has room for it; when a group runs out during decode, the newest sequence
is preempted and recomputed later. With space_admissions, while sequences decode, a step in which
a prompt ended its prefill (and goes on to decode) is followed by one that admits none
(EngineConfig says why). With async scheduling the scheduler also decides whether, and what,
the engine launches before the step in flight has its tokens read (`schedule_ahead`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sparse_core.cache.block_manager import Admission, BlockManager
from sparse_core.config import EngineConfig
from sparse_core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    # Prefilled in this step, whole or a chunk (each one's num_scheduled_tokens).
    prefills: list[Sequence]
    decodes: list[Sequence]  # done prefilling: one token each

    @property
    def seqs(self) -> list[Sequence]:
        """In the order of the step's rows: the prefills, then the decodes."""
        return self.prefills + self.decodes

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, min_last_chunk: int
    ) -> None:
        """min_last_chunk: the fewest tokens a chunked prompt's last chunk may have (a sparse
        policy's observation window: those queries score the whole prompt in that step)."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        if self.enable_chunked_prefill and self.max_num_batched_tokens < min_last_chunk:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least the "
                f"observation window ({min_last_chunk}): a prompt's last chunk holds the window"
            )
        self.min_last_chunk = min_last_chunk
        self.space_admissions = config.space_admissions
        self.max_model_len = config.max_model_len
        self.expected_input_len = config.expected_input_len  # the next prompt's, when ahead
        self._decoding_starts = False  # a prompt ends its prefill in the last step scheduled
        # A request finished (not aborted) since the last step_done / by the step before it.
        self._finished_since_step_done = False
        self._finished_last_step = False
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        """The next step: a token for every running sequence that is done prefilling, the next
        chunks of the prompts being prefilled, and the new prompts that fit (none, with
        space_admissions, right after a step in which a prompt ended its prefill and goes on to
        decode).

        Decoding sequences ride along with the prefill in one forward pass, so a burst of
        arrivals never stops them. A step that had to preempt admits nothing: the cache is full,
        and a new prompt would only be preempted in turn.
        """
        preemptions = self.num_preemptions
        decodes = self._prepare_decode()
        budget = self.max_num_batched_tokens
        prefills = []
        for seq in self.running:
            if not seq.is_prefilling:
                continue
            remaining = seq.prefill_len - seq.num_computed_tokens
            seq.num_scheduled_tokens = self._next_chunk(remaining, budget)
            if seq.num_scheduled_tokens == 0:
                budget = 0  # first come, first served: the later prompts wait too
                break
            prefills.append(seq)
            budget -= seq.num_scheduled_tokens
        if self.num_preemptions != preemptions:
            budget = 0
        admitted = self._admit_spaced(budget, bool(decodes), prefills)
        return ScheduledStep(prefills + admitted, decodes)

    def schedule_ahead(self, in_flight: ScheduledStep, wanted: list[bool]) -> ScheduledStep | None:
        """With async scheduling, after `step_done(in_flight)`: the next step, to launch before
        `in_flight`'s tokens reach the host, when it needs nothing of them but the tokens
        themselves: its decode rows are fed `in_flight`'s sampled tokens on the device (the
        device token pool), beside the waiting prompts that fit. Only when no prompt is being
        prefilled in chunks, every row of `in_flight` samples a token (`wanted`), and there is
        room without preempting.
        A sequence that `in_flight` finishes by length is left out; one that it ends with a stop
        token or string has one token computed in vain. None when the next step must wait.

        Not right after a step that finished a request: its client's next request (a closed
        loop, a chat's next turn) often arrives within a step, and a step launched ahead would
        hold it back for one more. Unless a prompt of the typical length (expected_input_len)
        could not join that step anyway: the prompts already waiting leave no slot or no room
        for it, or space_admissions keeps the step for decoding."""
        if self._finished_last_step and self.admits_another_prompt(self.expected_input_len):
            return None
        if not all(wanted):
            return None
        in_flight_seqs = set(in_flight.seqs)
        seqs = []
        for seq in self.running:
            if seq not in in_flight_seqs or seq.is_prefilling:
                return None
            # The token in flight is its last one?
            if len(seq.output_token_ids) + 1 >= seq.params.max_tokens:
                continue
            if len(seq) + 1 >= self.max_model_len:
                continue
            seqs.append(seq)
        return self._schedule_decodes(seqs) or None

    def _schedule_decodes(self, seqs: list[Sequence]) -> ScheduledStep | None:
        """A step for exactly these running sequences, done prefilling, and the waiting prompts
        that fit beside them (as in `schedule`), when every group has room for their next tokens
        (an empty step when there is nothing to run); None, changing nothing, when one would
        have to be preempted."""
        if not self.block_manager.can_append_all(seqs):
            return None
        for seq in seqs:
            self.block_manager.append_slot(seq)
            seq.num_scheduled_tokens = 1
        admitted = self._admit_spaced(self.max_num_batched_tokens, bool(seqs), [])
        return ScheduledStep(admitted, list(seqs))

    def admits_another_prompt(self, num_tokens: int) -> bool:
        """Whether a prompt of `num_tokens` arriving now could still join the next step, beside
        the prompts already waiting (which go first): a sequence slot left (max_num_seqs), and
        room in the step's tokens for the whole prompt (or the whole step, which a longer one
        takes alone), or with chunked prefill for a chunk.
        With space_admissions, while sequences decode, none joins the step after one in which
        a prompt ended its prefill and goes on to decode."""
        if len(self.running) + len(self.waiting) >= self.max_num_seqs:
            return False
        if not self._may_admit(any(not seq.is_prefilling for seq in self.running)):
            return False
        room = self.max_num_batched_tokens
        for seq in self.waiting:
            room -= seq.num_prefill_tokens
            if room <= 0:
                return False
        return self._next_chunk(num_tokens, room) > 0

    def _may_admit(self, decoding: bool) -> bool:
        """Whether the next step may admit prompts (`decoding`: it has decode rows): with
        space_admissions, not right after a step in which a prompt ended its prefill and goes
        on to decode."""
        return not (self.space_admissions and self._decoding_starts and decoding)

    def _admit_spaced(
        self, budget: int, decoding: bool, prefilling: list[Sequence]
    ) -> list[Sequence]:
        """The waiting prompts that join a step with `budget` prompt tokens left, beside the
        chunks of `prefilling`. Records whether a prompt begins to decode after this step: its
        prefill ends in it, and it has more than that one token to generate or (after a
        compressed prefix) tokens left to feed."""
        admitted = self._admit(budget) if budget > 0 and self._may_admit(decoding) else []
        self._decoding_starts = any(
            seq.num_computed_tokens + seq.num_scheduled_tokens >= seq.prefill_len
            and (
                seq.prefill_len < len(seq) or seq.params.max_tokens > len(seq.output_token_ids) + 1
            )
            for seq in prefilling + admitted
        )
        return admitted

    def step_done(self, step: ScheduledStep) -> None:
        """Account the tokens the step fed; a prefill's last chunk ends a chunked one's staging.
        Called as the step's tokens are about to be read: the requests finished since the last
        call were finished by the step before."""
        self._finished_last_step = self._finished_since_step_done
        self._finished_since_step_done = False
        for seq in step.decodes:
            seq.num_computed_tokens += 1
        for seq in step.prefills:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            if not seq.is_prefilling:
                self.block_manager.end_prefill(seq)

    def _next_chunk(self, remaining: int, budget: int) -> int:
        """Of a prefill's `remaining` tokens, those a step with `budget` left feeds; 0 to wait.
        Without chunked prefill a prefill longer than a step runs whole in a step of its own."""
        if remaining <= budget:
            return remaining
        if not self.enable_chunked_prefill:
            return remaining if budget == self.max_num_batched_tokens else 0
        return max(0, min(budget, remaining - self.min_last_chunk))

    def _admissible_chunk(self, seq: Sequence, budget: int) -> tuple[int, Admission | None]:
        """Tokens of a waiting prompt's prefill that a step with `budget` left admits (those
        after the ones found in the prefix cache), and the admission that allocates them; (0,
        None) when the budget or the pool's free blocks fall short."""
        admission = self.block_manager.admission(seq)
        remaining = seq.num_prefill_tokens - admission.num_cached_tokens
        chunk = self._next_chunk(remaining, budget)
        if chunk == 0:
            return 0, None
        # More chunks follow: a prefill that does not cache takes another count of blocks.
        if chunk < remaining and not admission.caches:
            admission = self.block_manager.admission(seq, chunked=True)
        return (chunk, admission) if admission.fits else (0, None)

    def _admit(self, budget: int) -> list[Sequence]:
        admitted: list[Sequence] = []
        while len(self.running) < self.max_num_seqs:
            seq = self._next_to_admit()
            if seq is None:
                break
            chunk, admission = self._admissible_chunk(seq, budget)
            if admission is None:
                break
            self.waiting.remove(seq)
            seq.start_prefill(self.block_manager.allocate(admission))
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = chunk
            self.running.append(seq)
            admitted.append(seq)
            budget -= chunk
        return admitted

    def _next_to_admit(self) -> Sequence | None:
        """The first waiting sequence; while suspects wait (sequences of a failed step), the
        first of them, and only when no other suspect runs: they run one at a time, beside the
        sequences that already had a step succeed, so that a step that fails again names its
        cause."""
        suspect = next((seq for seq in self.waiting if seq.suspect), None)
        if suspect is None:
            return self.waiting[0] if self.waiting else None
        if any(seq.suspect for seq in self.running):
            return None
        return suspect

    def preempt_after_failure(self) -> list[Sequence]:
        """After a step failed: the sequences that may have caused it, all running sequences
        preempted (what the step left half done is recomputed). The candidates are the suspects
        that ran (one at most), else every running sequence; each is marked a suspect."""
        candidates = [seq for seq in self.running if seq.suspect] or list(self.running)
        if not candidates and self.waiting:  # it failed admitting the first one
            candidates = [self.waiting[0]]
        for seq in candidates:
            seq.suspect = True
            seq.num_failed_steps += 1
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running = []
        return candidates

    def _prepare_decode(self) -> list[Sequence]:
        """Make room for one token per sequence done prefilling, preempting the newest when a
        group is full; the oldest sequences keep making progress. Prompts being prefilled hold
        their blocks already."""
        kept: list[Sequence] = []
        decodes: list[Sequence] = []
        while self.running:
            seq = self.running.pop(0)
            if seq.is_prefilling:
                kept.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:  # alone and no room: RequestChecker.why_never_fits rules this out
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                seq.num_scheduled_tokens = 1
                kept.append(seq)
                decodes.append(seq)
        self.running = kept
        return decodes

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is prefilled again (prompt + outputs so far) later."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its blocks, wherever the sequence is. A finish other than an
        abort holds the next step launched ahead back (`schedule_ahead`)."""
        if reason != "abort":
            self._finished_since_step_done = True
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            seq.final_kv_lens = list(seq.kv_lens)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
