"""Continuous batching: each step is either a prefill of newly admitted prompts or one decode
token for every running sequence (a generated one, or a prompt token fed after a compressed
prefix). A prompt is admitted only when every layer group has room for
it; when a group runs out during decode, the newest sequence is preempted and recomputed later."""

from __future__ import annotations

from collections import deque

from sparse_core.cache.block_manager import BlockManager
from sparse_core.config import EngineConfig
from sparse_core.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._decode_due = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill step.

        Prompts are admitted as soon as they fit, but never in two steps back to back while
        sequences are running: a decode step goes between. During a burst of arrivals the
        running sequences keep making progress, so they finish (and their clients come back)
        spread out over time instead of all at once, which keeps later time-to-first-token low.
        """
        if not (self._decode_due and self.running):
            admitted = self._admit()
            if admitted:
                self._decode_due = True
                return admitted, True
        self._decode_due = False
        return self._prepare_decode(), False

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
                else:  # alone and no room: requests are checked with why_never_fits, so unreachable
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
