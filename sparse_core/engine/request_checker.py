"""Request validation from an engine's fixed facts (limits, vocabulary, pool sizes), with no
engine state: a front end in another process checks a request exactly as the engine would."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sparse_core.cache.retention import KVRetention
from sparse_core.models.tokenizer import Tokenizer
from sparse_core.sampling_params import SamplingParams
from sparse_core.sequence import Sequence


@dataclass
class RequestChecker:
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    retention: KVRetention
    num_blocks: int  # the pool's, shared by every KV group
    longest_whole_prefill: int  # EngineConfig's: a longer prefill goes in chunks

    def make_sequence(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Sequence:
        """Validate and tokenise a request; raises ValueError naming the problem."""
        params.verify(self.vocab_size)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            vocab = self.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt is empty")
        prefix = params.compress_prefix_len
        if prefix is not None and prefix > len(token_ids):
            raise ValueError(
                f"compress_prefix_len ({prefix}) exceeds the prompt's {len(token_ids)} tokens; it "
                f"counts the prompt tokens to prefill and compress before the rest is fed"
            )
        limit = self.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {limit}, which must leave "
                f"room for at least one generated token"
            )
        if params.max_tokens is None:  # as many as the context leaves (checks min_tokens again)
            params = dataclasses.replace(params, max_tokens=limit - len(token_ids))
        if params.min_tokens:  # the sampler bans EOS until then
            params = dataclasses.replace(params, eos_token_ids=self.tokenizer.eos_token_ids)
        seq = Sequence(request_id, token_ids, params, len(self.retention.groups), prompt=text)
        reason = self.why_never_fits(seq)
        if reason is not None:
            raise ValueError(reason)
        return seq

    def why_never_fits(self, seq: Sequence) -> str | None:
        """Why the sequence could not finish even alone in the cache, or None if it can."""
        prefill = seq.num_prefill_tokens
        # A prefill longer than a step goes in chunks, and until its last one every group holds
        # all of it. After a preemption the prefill is the sequence so far (unless it compresses
        # a fixed prefix), up to its last token but one.
        longest_prefill = prefill
        if seq.params.compress_prefix_len is None:
            longest_prefill = min(len(seq) + seq.params.max_tokens, self.max_model_len) - 1
        chunked = longest_prefill if longest_prefill > self.longest_whole_prefill else 0
        later = len(seq) - prefill + seq.params.max_tokens
        need = sum(
            g.blocks(g.peak_tokens(prefill, later, chunked, longest_prefill))
            for g in self.retention.groups
        )
        if need > self.num_blocks:
            return (
                f"the prompt plus max_tokens needs {need} KV blocks, and the cache has "
                f"{self.num_blocks}; shorten the request or raise kv_cache_memory_gb"
            )
        return None
