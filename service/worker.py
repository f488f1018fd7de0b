"""One engine behind the HTTP layer: prompt preparation, validation, streaming, metrics.

The same class runs in the standalone server's process and inside each Ray Serve engine replica;
everything it takes and yields is plain data so that it can cross a process boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from service.errors import APIError, invalid_value
from service.messages import Chunk, GenerateRequest, RoutingStats, TextLogprobs
from service.metrics import MetricsRecorder
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.async_engine import AsyncLLM
from sparse_core.outputs import RequestOutput, TokenLogprobs
from sparse_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


ENGINES = ("native", "vllm")
# What a logprob of -inf is written as, as vLLM writes it (JSON has no infinity).
MIN_LOGPROB = -9999.0


class EngineWorker:
    """`llm` is our AsyncLLM (engine "native") or service.vllm_engine.VllmAsyncLLM ("vllm")."""

    def __init__(
        self,
        llm: AsyncLLM,
        config: EngineConfig,
        metrics: MetricsRecorder,
        log_prompts: bool = False,
    ) -> None:
        self.llm = llm
        self.config = config
        self.metrics = metrics
        self.log_prompts = log_prompts
        self.max_model_len = config.max_model_len
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="kvsparse-tokenizer")

    @classmethod
    def start(
        cls,
        engine_config: EngineConfig,
        sparsity: SparsityConfig,
        metrics: MetricsRecorder,
        log_prompts: bool = False,
        engine: str = "native",
        engine_process: bool | None = None,
    ) -> EngineWorker:
        """engine_process: our engine in a process of its own (default: on a GPU only)."""
        if engine == "native":
            llm = AsyncLLM(engine_config, sparsity, engine_process=engine_process)
            metrics.layer_plan(llm.checker.retention.layer_plan)
        elif engine == "vllm":
            from service.vllm_engine import VllmAsyncLLM

            llm = VllmAsyncLLM(engine_config, sparsity)
        else:
            raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
        return cls(llm, engine_config, metrics, log_prompts)

    # -- requests -----------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """Chunks of one request; APIError before the first chunk if the request is invalid."""
        arrival = time.monotonic()
        if not self.healthy():
            self.metrics.failed()
            raise APIError(503, "the engine has stopped; retry later", code="engine_stopped",
                           retry_after=1)  # fmt: skip
        try:
            prompt_ids, params, outputs = await self._validate(req)
        except APIError as exc:
            if exc.status >= 500:  # an invalid request is the client's error, not counted
                self.metrics.failed()
            raise
        if self.log_prompts:
            logger.info("request %s prompt: %r", req.request_id, req.prompt or req.messages)

        n_prompt = len(prompt_ids)
        # Text that may still turn out to start a stop string is held back until it cannot.
        hold = max((len(s) for s in params.stop), default=1) - 1
        sent_chars = sent_tokens = 0
        last_token_time: float | None = None
        first_token_time: float | None = None
        reason = "abort"  # unless the engine says otherwise: the consumer went away
        ids = req.return_token_ids  # vLLM's: the prompt's ids go with the first token's
        try:
            # The request is queued already: closed from here on, even before the response
            # starts, this stream aborts it.
            async with contextlib.aclosing(outputs):
                yield Chunk("", 0, n_prompt)
                async for out in outputs:
                    now = time.monotonic()
                    new_tokens = len(out.token_ids) - sent_tokens
                    if new_tokens > 0:
                        if sent_tokens == 0:
                            first_token_time = now
                            self.metrics.first_token(now - arrival)
                            self.metrics.prompt_tokens(n_prompt)
                        gap = now - last_token_time if last_token_time is not None else None
                        self.metrics.tokens(new_tokens, gap)
                        last_token_time = now
                    new_ids = list(out.token_ids[sent_tokens:]) if ids else []
                    prompt_out = list(prompt_ids) if ids and sent_tokens == 0 else None
                    logprobs = self._text_logprobs((out.logprobs or [])[sent_tokens:])
                    sent_tokens = len(out.token_ids)
                    end = len(out.text) if out.finished else max(sent_chars, len(out.text) - hold)
                    text, sent_chars = out.text[sent_chars:end], end
                    cached = out.num_cached_tokens
                    if out.finished:
                        reason = out.finish_reason or "stop"
                        tpot = (
                            (now - first_token_time) / (sent_tokens - 1)
                            if sent_tokens > 1 and first_token_time is not None
                            else None
                        )
                        self.metrics.finished(reason, now - arrival, out.compression_ratio, tpot)
                        yield Chunk(text, sent_tokens, n_prompt, reason, out.compression_ratio,
                                    cached, new_ids, prompt_out, logprobs)  # fmt: skip
                        return
                    if new_tokens > 0:  # one chunk per step, like OpenAI's chunk per token
                        yield Chunk(text, sent_tokens, n_prompt, cached_tokens=cached,
                                    token_ids=new_ids, prompt_token_ids=prompt_out,
                                    logprobs=logprobs)  # fmt: skip
        except Exception as exc:
            reason = "error"
            logger.warning("request %s failed: %s", req.request_id, exc)
            raise APIError(500, f"generation failed: {exc}", code="engine_error") from None
        finally:
            if reason == "abort":
                self.metrics.finished("abort", time.monotonic() - arrival, None)
            elif reason == "error":
                self.metrics.failed()
            self.metrics.engine_state(self.llm.stats())

    def _text_logprobs(self, entries: list[TokenLogprobs]) -> list[TextLogprobs]:
        """The logprobs with their tokens' text (`Tokenizer.token_text`: each id decoded once,
        then remembered)."""
        text = self.llm.tokenizer.token_text

        def finite(logprob: float) -> float:
            return max(logprob, MIN_LOGPROB)

        return [
            TextLogprobs(
                text(e.token_id), finite(e.logprob), [(text(t), finite(lp)) for t, lp in e.top]
            )
            for e in entries
        ]

    async def _validate(
        self, req: GenerateRequest
    ) -> tuple[list[int], SamplingParams, AsyncIterator[RequestOutput]]:
        """The request's prompt ids, sampling params and engine stream (our engine has queued
        the request already; vLLM's queues it when the stream is first read).

        Nothing here may hold the event loop for long, or every stream and `/health` would
        wait: a text longer than the context could hold is refused by its size, and the
        tokenizer and chat template run on a thread of their own (one: a Hugging Face tokenizer
        is not safe to call from two threads at once)."""
        self._check_size(req)
        loop = asyncio.get_running_loop()
        prompt_ids, param = await loop.run_in_executor(self._tokenizing, self._prompt_ids, req)
        params = req.params
        self._check_room(params, len(prompt_ids))
        try:
            # The engine validates eagerly (KV capacity, ids, fields against the vocabulary):
            # errors are 4xx before streaming.
            outputs = self.llm.generate(prompt_ids, params, request_id=req.request_id)
        except ValueError as exc:
            raise invalid_value(exc, param) from None
        return prompt_ids, params, outputs

    def _check_size(self, req: GenerateRequest) -> None:
        """Refuse a text prompt that has more tokens than the context for its length alone."""
        if req.messages is not None:
            param, chars = "messages", sum(len(m["content"]) for m in req.messages)
        elif isinstance(req.prompt, str):
            param, chars = "prompt", len(req.prompt)
        else:
            return
        try:
            per_token = self.llm.tokenizer.max_token_chars
        except ValueError:  # no tokenizer: refused with its reason when tokenized
            return
        limit = self.max_model_len * per_token
        if chars > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, and the "
                f"{param} has {chars} characters, more than that many tokens can hold (at most "
                f"{per_token} characters each)",
                param=param,
                code="context_length_exceeded",
            )

    def _prompt_ids(self, req: GenerateRequest) -> tuple[list[int], str]:
        tokenizer = self.llm.tokenizer
        param = "messages" if req.messages is not None else "prompt"
        try:
            if req.messages is not None:
                ids = tokenizer.encode_chat(req.messages)  # the model's own chat template
            elif isinstance(req.prompt, str):
                ids = tokenizer.encode(req.prompt) if req.prompt else []
            else:
                ids = list(req.prompt or [])
        except ValueError as exc:  # no tokenizer, no chat template
            raise APIError(400, str(exc), param=param) from None
        if not ids:
            raise APIError(400, f"{param} is empty", param=param)
        if len(ids) >= self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {len(ids)} tokens (at least one must be left to generate)",
                param=param,
                code="context_length_exceeded",
            )
        return ids, param

    def _check_room(self, params: SamplingParams, n_prompt: int) -> None:
        """Refuse a max_tokens that the context cannot hold beside the prompt, as OpenAI does
        (None takes what is left)."""
        room = self.max_model_len - n_prompt
        if params.max_tokens is not None and params.max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, but "
                f"{n_prompt + params.max_tokens} were requested ({n_prompt} in the prompt, "
                f"{params.max_tokens} for the completion)",
                param="max_tokens",
                code="context_length_exceeded",
            )

    # -- state --------------------------------------------------------------------------------

    def routing_stats(self) -> RoutingStats:
        stats = self.llm.stats()
        free = 1.0 - stats.kv_used_fraction
        max_seqs = self.config.max_num_seqs
        per_request = (1.0 - free) / stats.num_running if stats.num_running else 1.0 / max_seqs
        return RoutingStats(free, per_request, stats.num_running, stats.num_waiting, max_seqs)

    def healthy(self) -> bool:
        return self.llm.is_running

    async def publish_metrics_forever(self, interval_s: float = 1.0) -> None:
        """Engine gauges (running, waiting, KV blocks) also move while no request is answered."""
        while True:
            self.metrics.engine_state(self.llm.stats())
            await asyncio.sleep(interval_s)

    def shutdown(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self.llm.shutdown()
