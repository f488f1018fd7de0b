"""The accuracy suite (sparse_core.eval) run through stock vLLM with the plugin."""

from __future__ import annotations

from typing import Any

from sparse_core.eval.runner import EvalConfig, RunSettings, SampleResult
from sparse_core.eval.tasks import Sample, score
from sparse_core.models.loader import load_model_source
from sparse_core.policy import plan_layers
from sparse_core.vllm_plugin.engine import vllm_llm


def run_suite_vllm(
    configs: list[EvalConfig],
    samples: list[Sample],
    settings: RunSettings,
    engine_args: dict[str, Any] | None = None,
) -> list[SampleResult]:
    """Like `sparse_core.eval.runner.run_suite`: one vLLM engine per (config, prompt length)."""
    from vllm import SamplingParams, TokensPrompt

    model = load_model_source(settings.model).config
    results: list[SampleResult] = []
    by_length: dict[int, list[Sample]] = {}
    for s in samples:
        by_length.setdefault(s.length, []).append(s)
    for config in configs:
        for length, group in sorted(by_length.items()):
            sparsity = config.sparsity(
                length, model.num_hidden_layers, model.name, settings.window, settings.sinks
            )
            plan = plan_layers(sparsity, model.num_hidden_layers, model.name).at_length(length)
            args = {"max_model_len": length + 64, **(engine_args or {})}
            with vllm_llm(settings.model, sparsity, length, **args) as llm:
                prompts = [TokensPrompt(prompt_token_ids=s.prompt_ids) for s in group]
                params = [SamplingParams(max_tokens=s.max_tokens, temperature=0.0) for s in group]
                outs = llm.generate(prompts, params, use_tqdm=False)
            for s, out in zip(group, outs, strict=True):
                n = len(s.prompt_ids)
                kept = sum(len(g.layers) * g.kept_tokens(n) for g in plan.groups)
                text = out.outputs[0].text
                results.append(
                    SampleResult(
                        config=config.name,
                        task=s.task,
                        length=s.length,
                        index=s.index,
                        depth=s.depth,
                        prompt_tokens=n,
                        score=score(s, text),
                        compression=model.num_hidden_layers * n / kept,
                        output=text,
                    )
                )
    return results
