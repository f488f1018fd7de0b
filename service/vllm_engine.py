"""`engine: vllm`: stock vLLM with the kvsparse plugin, behind the interface EngineWorker uses.

It offers what `sparse_core.engine.async_engine.AsyncLLM` offers the worker (`tokenizer`,
`generate`, `stats`, `is_running`, `shutdown`), so a replica runs either engine. vLLM's own
`AsyncLLM` does the work; its scheduler statistics reach `stats()` through a stat logger, vLLM's
seam for them. Requires vLLM in the environment (`pip install 'kvsparse[vllm]'`).

A `dummy:<preset>` model (random weights, the benchmarks' shape) runs as in the native engine:
vLLM loads random weights and no tokenizer (`load_format="dummy"`, `skip_tokenizer_init`), and
text is the preset's byte tokenizer's, detokenized here as the native engine does it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.detokenizer import IncrementalDetokenizer
from sparse_core.engine.llm_engine import EngineStats
from sparse_core.models.loader import load_model_source
from sparse_core.models.tokenizer import ByteTokenizer, Tokenizer
from sparse_core.outputs import RequestOutput, TokenLogprobs
from sparse_core.policy import plan_layers
from sparse_core.sampling_params import SamplingParams


class VllmAsyncLLM:
    def __init__(self, config: EngineConfig, sparsity: SparsityConfig) -> None:
        from sparse_core.vllm_plugin.engine import (
            dummy_model_args,
            ensure_entry_point,
            plugin_config,
            profile_name,
            vllm_model_path,
        )

        if config.gpu_memory_limit_gb is not None:
            raise ValueError(
                "gpu_memory_limit_gb is not supported with engine 'vllm': vLLM's budget is "
                "gpu_memory_utilization, a fraction of the GPU's memory (e.g. 0.17 of a "
                "140 GiB GPU for 24 GiB)"
            )
        ensure_entry_point()
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from sparse_core.engine.device import config_on_device

        self.config = config = config_on_device(config)
        name = profile_name(config.model)
        path = vllm_model_path(config.model)
        hf = json.loads((Path(path) / "config.json").read_text())
        self.num_layers = hf["num_hidden_layers"]
        self.vocab_size: int = hf["vocab_size"]
        self.plan = plan_layers(sparsity, self.num_layers, name).at_length(
            config.expected_input_len
        )
        self.dummy = config.model.startswith("dummy:")
        self.tokenizer: Tokenizer | ByteTokenizer
        if self.dummy:
            self.tokenizer = load_model_source(config.model).tokenizer
        else:
            eos = hf.get("eos_token_id")
            self.tokenizer = Tokenizer.from_hf_dir(
                Path(path),
                hf["vocab_size"],
                hf.get("bos_token_id"),
                [eos] if isinstance(eos, int) else list(eos or []),
            )
        self._stats = EngineStats(0, 0, 0, {})
        args: dict[str, Any] = {
            "model": path,
            "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "enforce_eager": config.enforce_eager,
            "tensor_parallel_size": config.tensor_parallel_size,
            "seed": config.seed,
            "additional_config": plugin_config(sparsity, name, config.expected_input_len),
        }
        if config.dtype is not None:
            args["dtype"] = config.dtype
        if config.quantization is not None:  # vLLM's own FP8 weights (the same flag)
            args["quantization"] = config.quantization
        if config.kv_cache_dtype != "auto":  # the plugin's FP8 KV cache
            args["kv_cache_dtype"] = config.kv_cache_dtype
        if config.kv_cache_memory_gb is not None:
            args["kv_cache_memory_bytes"] = int(config.kv_cache_memory_gb * 2**30)
        args |= dummy_model_args(config.model)
        self._vllm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**args), stat_loggers=[self._stat_logger]
        )

    def _stat_logger(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from sparse_core.vllm_plugin.stats import StatsSink

        return StatsSink(vllm_config, self._set_stats)

    def _set_stats(self, stats: EngineStats) -> None:
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def is_running(self) -> bool:
        return not self._vllm.errored

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Checked now (ValueError); queued when first iterated (vLLM queues a request as its
        stream starts), where our AsyncLLM queues it at once."""
        if getattr(params, "compress_prefix_len", None) is not None:
            raise ValueError("compress_prefix_len is not supported with engine 'vllm'")
        if self.dummy and params.stop:
            raise ValueError("stop strings need vLLM's tokenizer, which a dummy model has not")
        params.verify(self.vocab_size)
        return self._stream(list(prompt_ids), _vllm_params(params), request_id)

    async def _stream(
        self, prompt_ids: list[int], params: Any, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        from vllm import TokensPrompt

        n = len(prompt_ids)
        kept = {g.name: g.kept_tokens(n) for g in self.plan.groups}
        ratio = self.num_layers * n / self.plan.token_layers(kept)
        finished = False
        # A dummy model's text: vLLM has no tokenizer for it.
        detokenizer = IncrementalDetokenizer(self.tokenizer) if self.dummy else None
        text = ""
        # The logprobs converted so far: vLLM's cumulative outputs repeat every earlier token's.
        logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        try:
            async for out in self._vllm.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), params, request_id
            ):
                completion = out.outputs[0]
                finished = out.finished
                token_ids = list(completion.token_ids)
                if detokenizer is not None:
                    for token_id in token_ids[len(detokenizer.token_ids) :]:
                        text += detokenizer.append(token_id)
                if logprobs is not None:
                    done = len(logprobs)
                    new = zip(completion.logprobs[done:], token_ids[done:], strict=True)
                    logprobs += [_token_logprobs(p, t, params.logprobs) for p, t in new]
                yield RequestOutput(
                    request_id=request_id,
                    prompt=None,
                    prompt_token_ids=prompt_ids,
                    token_ids=token_ids,
                    text=text if detokenizer is not None else completion.text,
                    finished=finished,
                    finish_reason=completion.finish_reason if finished else None,
                    kv_tokens_per_group=kept,
                    compression_ratio=ratio,
                    num_cached_tokens=out.num_cached_tokens or 0,
                    logprobs=None if logprobs is None else list(logprobs),
                )
        finally:
            if not finished:  # the consumer went away: free the request's blocks now
                await self._vllm.abort(request_id)

    def shutdown(self) -> None:
        self._vllm.shutdown()


def _vllm_params(params: SamplingParams) -> Any:
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    # Every field of ours that vLLM has means the same there (vLLM's vocabulary); the lists
    # are copied, vLLM may extend them.
    shared = {
        f.name: list(value) if isinstance(value := getattr(params, f.name), list) else value
        for f in dataclasses.fields(params)
        if f.name in VllmSamplingParams.__struct_fields__
    }
    shared["top_k"] = params.top_k or -1  # ours: 0 = off; vLLM's: -1 (or 0) = off
    return VllmSamplingParams(**shared, output_kind=RequestOutputKind.CUMULATIVE)


def _token_logprobs(position: dict[int, Any], chosen: int, num_top: int) -> TokenLogprobs:
    """vLLM's logprobs of one generated token ({token id: Logprob} of the sampled token and the
    `num_top` most likely, each with its rank; raw logprobs, as ours) as the native engine's."""
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in position.items())
    top = [(token, logprob) for rank, token, logprob in ranked if rank <= num_top]
    return TokenLogprobs(chosen, position[chosen].logprob, top[:num_top])
