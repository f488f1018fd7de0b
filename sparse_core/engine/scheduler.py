"""Continuous batching: every step feeds one token to each running sequence (a generated one, or
a prompt token fed after a compressed prefix) and, in the same forward pass, prefills the prompts
admitted for it. A prompt is admitted only when every layer group has room for it; when a group
runs out during decode, the newest sequence is preempted and recomputed later."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sparse_core.cache.block_manager import BlockManager
from sparse_core.config import EngineConfig
from sparse_core.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    prefills: list[Sequence]  # admitted for this step: prefilled whole (or their prefix)
    decodes: list[Sequence]  # already running: one token each

    @property
    def seqs(self) -> list[Sequence]:
        """In the order of the step's rows: the prefills, then the decodes."""
        return self.prefills + self.decodes

    @property
    def is_prefill_row(self) -> list[bool]:
        return [True] * len(self.prefills) + [False] * len(self.decodes)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
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
        """The next step: a token for every running sequence, and the prompts that fit.

        Decoding sequences ride along with the prefill in one forward pass, so a burst of
        arrivals never stops them. A step that had to preempt admits nothing: the cache is full,
        and a new prompt would only be preempted in turn.
        """
        preemptions = self.num_preemptions
        decodes = self._prepare_decode()
        prefills = self._admit() if self.num_preemptions == preemptions else []
        return ScheduledStep(prefills, decodes)

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if num_tokens + seq.num_prefill_tokens > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            num_tokens += seq.num_prefill_tokens
        return admitted

    def _prepare_decode(self) -> list[Sequence]:
        """Make room for one token per running sequence, preempting the newest when a group is
        full; the oldest sequences keep making progress."""
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.pop(0)
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:  # alone and no room: RequestChecker.why_never_fits rules this out
                    self._preempt(seq)
                    break
            else:
                seq.decode_slots = self.block_manager.append_slots(seq)
                scheduled.append(seq)
        self.running = scheduled
        return list(scheduled)

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is prefilled again (prompt + outputs so far) later."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its blocks, wherever the sequence is."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
