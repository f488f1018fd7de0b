"""`LLM`: offline batched generation, the vLLM way."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.engine.llm_engine import LLMEngine
from sparse_core.models.loader import ModelSource
from sparse_core.outputs import RequestOutput
from sparse_core.sampling_params import SamplingParams


class LLM:
    """Load a model once and generate for many prompts with continuous batching.

    `model` is the built-in alias "smollm2-135m-instruct", a local Hugging Face directory, a
    .gguf file, or "dummy:<preset>" (random weights). Other keyword arguments are EngineConfig
    fields (max_num_seqs, max_model_len, kv_cache_memory_gb, device, dtype,
    tensor_parallel_size, ...). With tensor_parallel_size > 1, call `shutdown()` (or use
    `with LLM(...) as llm:`) to stop the worker processes.
    """

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        sparsity: SparsityConfig | None = None,
        model_source: ModelSource | None = None,
        **engine_args: Any,
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(model=model, **engine_args), sparsity or SparsityConfig(), model_source
        )
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every prompt is validated before any runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(params_list)} sampling params were given"
            )
        seqs = []
        for prompt, p in zip(prompts, params_list, strict=True):
            seqs.append(self.engine.make_sequence(f"gen-{self._counter}", prompt, p))
            self._counter += 1
        for seq in seqs:
            self.engine.add_sequence(seq)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(seqs), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[seq.request_id] for seq in seqs]

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
    ) -> RequestOutput:
        return self.generate([self.tokenizer.encode_chat(messages)], sampling_params)[0]
