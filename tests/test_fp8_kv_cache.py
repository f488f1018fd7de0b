"""The FP8 KV cache (`kv_cache_dtype="fp8"`) in the engine: memory counted in bytes, bad names
refused, and the built-in model's greedy choices kept while decode reads e4m3 pages (the kernels
against the reference: tests/test_triton_kernels.py, "FP8 caches")."""

from __future__ import annotations

import pytest

from sparse_core import LLM, EngineConfig, SamplingParams, SparsityConfig

MODEL = "smollm2-135m-instruct"
CONTEXT = (
    "The lighthouse keeper kept a log of every ship that passed the cape. In spring the "
    "fishing boats came first, then the ferries, and in summer the tall ships of the regatta. "
    "He wrote down the weather, the colour of the sea and the names painted on the hulls. "
)
QUESTIONS = [
    "What did the keeper write down?",
    "Who kept the log?",
]


def test_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype 'fp8_e5m2'.*'fp8'"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_an_fp8_cache_holds_twice_the_tokens_in_the_same_memory():
    """The cache's blocks count bytes: one byte per value instead of the model's float32 here."""
    blocks = {}
    for dtype in ("auto", "fp8"):
        with LLM(
            model=MODEL, max_model_len=256, kv_cache_memory_gb=0.05, kv_cache_dtype=dtype
        ) as llm:
            runner = llm.engine.runner
            blocks[dtype] = llm.engine.block_manager.pool.num_blocks
            itemsize = runner.model.attention_layers[0].k_cache.element_size()
            assert itemsize == (1 if dtype == "fp8" else runner.dtype.itemsize)
    assert blocks["fp8"] / blocks["auto"] >= 3.9, blocks  # float32 on CPU: 4 bytes to 1


@pytest.mark.parametrize(
    "sparsity,engine_args",
    [
        (SparsityConfig(policy="dense"), {}),
        pytest.param(
            SparsityConfig(policy="snapkv", budget=24, window=4, sinks=2, full_layers=3),
            {"enable_chunked_prefill": True, "max_num_batched_tokens": 32},
            marks=pytest.mark.slow,  # ~2 min on 2 cores; the kernels' FP8 tests cover its paths
        ),
    ],
    ids=["dense", "snapkv-chunked"],
)
def test_fp8_kv_cache_keeps_most_greedy_tokens_of_the_built_in_model(sparsity, engine_args):
    """Teacher-forced through the cache: each prompt's prefix is prefilled (in chunks that read
    the earlier ones back from the FP8 pages, and compressed on write with snapkv), then the
    unquantized run's own output is fed one token per decode step, and the FP8 cache's greedy
    choice after every token is compared with it."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [CONTEXT + q for q in QUESTIONS]
    with LLM(model=MODEL, max_model_len=256, sparsity=sparsity, **engine_args) as llm:
        prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
        reference = [o.token_ids for o in llm.generate(prompts, greedy)]
    with LLM(
        model=MODEL, max_model_len=256, sparsity=sparsity, kv_cache_dtype="fp8", **engine_args
    ) as llm:
        requests, params = [], []
        for ids, ref in zip(prompt_ids, reference, strict=True):
            for i in range(len(ref)):
                requests.append(ids + ref[:i])
                params.append(
                    SamplingParams(max_tokens=1, temperature=0.0, compress_prefix_len=len(ids))
                )
        chosen = [o.token_ids[0] for o in llm.generate(requests, params)]
    expected = [t for ref in reference for t in ref]
    agreement = sum(a == b for a, b in zip(chosen, expected, strict=True)) / len(expected)
    print(f"FP8 KV cache: {agreement:.1%} of {len(expected)} greedy tokens kept")
    assert agreement >= 0.85, f"the FP8 cache chose the bf16 cache's token {agreement:.0%}"
