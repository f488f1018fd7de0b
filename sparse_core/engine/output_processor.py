"""A step's sampled tokens into RequestOutputs: each token appended to its sequence, the text
detokenized incrementally, stop conditions checked, and the sequences they end finished."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sparse_core.engine.detokenizer import IncrementalDetokenizer
from sparse_core.outputs import RequestOutput, TokenLogprobs

if TYPE_CHECKING:
    from sparse_core.engine.scheduler import ScheduledStep, Scheduler
    from sparse_core.models.tokenizer import Tokenizer
    from sparse_core.policy import LayerPlan
    from sparse_core.sequence import Sequence


class OutputProcessor:
    """Holds the live requests (added, not yet finished) and their detokenizers."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        plan: LayerPlan,
        num_hidden_layers: int,
        max_model_len: int,
    ) -> None:
        """`scheduler`: where the sequences the outputs end are finished (their blocks freed)."""
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.plan = plan
        self.num_hidden_layers = num_hidden_layers
        self.max_model_len = max_model_len
        self.sequences: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        self.sequences[seq.request_id] = seq
        self._detokenizers[seq.request_id] = IncrementalDetokenizer(self.tokenizer)

    def process(
        self,
        step: ScheduledStep,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        wanted: list[bool],
        now: float,
    ) -> list[RequestOutput]:
        """The outputs of a step read back at `now`: `tokens`, `logprobs` (None for rows that
        did not ask) and `wanted` per row, in `step.seqs` order; rows not wanted (a forced
        token's or an early chunk's prediction) give none."""
        outputs = []
        for seq, token, token_logprobs, sampled in zip(
            step.seqs, tokens, logprobs, wanted, strict=True
        ):
            # Finished: aborted, or ended by the step before, while this one ran.
            if not sampled or seq.is_finished:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.output_token_ids.append(token)
            if token_logprobs is not None:
                seq.output_logprobs.append(token_logprobs)
            reason = self._append_text(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                outputs.append(self.release(seq))
            else:
                outputs.append(self.output(seq))
        return outputs

    def _append_text(self, seq: Sequence, token: int) -> str | None:
        """Extend the text with the new token; the finish reason if the sequence is done."""
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.tokenizer.eos_token_ids
        ):
            return "stop"
        new_text = self._detokenizers[seq.request_id].append(token)
        if new_text:
            seq.text += new_text
            # Before min_tokens outputs, stop strings do not end the request (as in vLLM).
            for stop in params.stop if len(seq.output_token_ids) > params.min_tokens else ():
                # A stop string can only start inside the last len(new_text) + len(stop) chars.
                at = seq.text.find(stop, max(0, len(seq.text) - len(new_text) - len(stop)))
                if at != -1:
                    seq.text = seq.text[:at]
                    return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def release(self, seq: Sequence) -> RequestOutput:
        """The last output of a finished sequence, which leaves the live requests."""
        output = self.output(seq)
        output.finish_time = time.monotonic()
        del self.sequences[seq.request_id]
        del self._detokenizers[seq.request_id]
        return output

    def output(self, seq: Sequence) -> RequestOutput:
        names = [g.name for g in self.plan.groups]
        kept = dict(zip(names, seq.prompt_kv_lens, strict=False))
        kept_token_layers = sum(
            len(g.layers) * n for g, n in zip(self.plan.groups, seq.prompt_kv_lens, strict=False)
        )
        prompt_token_layers = len(seq.prompt_token_ids) * self.num_hidden_layers
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            kv_tokens_per_group=kept,
            kv_tokens_held=dict(zip(names, seq.final_kv_lens, strict=False)),
            compression_ratio=prompt_token_layers / kept_token_layers if kept_token_layers else 1.0,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            logprobs=None if seq.params.logprobs is None else list(seq.output_logprobs),
        )
