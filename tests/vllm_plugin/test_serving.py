"""`kvsparse serve --engine vllm`: the OpenAI server with stock vLLM + plugin under a pool."""

from __future__ import annotations

import dataclasses
import re

import httpx
import pytest

from service.settings import PoolSpec, ServerSettings
from service.standalone import build_standalone_app
from sparse_core import LLM, EngineConfig, SamplingParams, SparsityConfig
from sparse_core.eval.tasks import TaskBuilder
from tests.service.servers import run_server
from tests.vllm_plugin.conftest import MODEL

pytest.importorskip("vllm")

SPARSE = SparsityConfig(policy="snapkv", budget=96, window=16, sinks=4, full_layers=3)
ENGINE = EngineConfig(
    model=MODEL,
    max_model_len=1024,
    max_num_seqs=4,
    dtype="float32",
    enforce_eager=True,
    gpu_memory_utilization=0.5,
    kv_cache_memory_gb=0.5,
)
MAX_TOKENS = 16
TOP_LOGPROBS = 3
# Two float32 CPU implementations of one model agree to ~1e-4. With FP8 KV pages they pick the
# same tokens, but their pages' scales differ (vLLM's default 1.0, ours measured), which moves
# some logprobs by 0.2: there only the shapes are compared.
LOGPROB_TOLERANCE = 2e-3


def _serve_one(prompt: list[int], kv_cache_dtype: str) -> float:
    """One completion through `kvsparse serve --engine vllm`, checked against the native
    engine's text and logprobs with the same KV cache dtype; vLLM's free KV blocks on the
    server's gauge."""
    native = LLM(
        model=MODEL,
        sparsity=SPARSE,
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        kv_cache_memory_gb=0.25,
        kv_cache_dtype=kv_cache_dtype,
    )
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    expected = native.generate([prompt], params)[0]
    assert expected.logprobs is not None

    settings = ServerSettings(
        served_model_names=[MODEL], max_model_len=1024, pools=[PoolSpec.of(SPARSE)]
    )
    engine = dataclasses.replace(ENGINE, kv_cache_dtype=kv_cache_dtype)
    app = build_standalone_app(engine, [SPARSE], settings, engine="vllm")
    with run_server(app, None) as server:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": TOP_LOGPROBS,
        }
        reply = httpx.post(f"{server.v1}/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        result = reply.json()
        assert result["choices"][0]["text"] == expected.text
        assert result["usage"]["completion_tokens"] == MAX_TOKENS
        logprobs = result["choices"][0]["logprobs"]
        metrics = server.metrics()
    # vLLM's logprobs, as the native engine's: the chosen token's, then the top ones in order
    # (the chosen token is the most likely: greedy).
    compare = kv_cache_dtype == "auto"
    want = [e.logprob for e in expected.logprobs]
    assert len(logprobs["token_logprobs"]) == len(want)
    assert not compare or logprobs["token_logprobs"] == pytest.approx(want, abs=LOGPROB_TOLERANCE)
    for top, entry in zip(logprobs["top_logprobs"], expected.logprobs, strict=True):
        values = list(top.values())
        assert len(values) == TOP_LOGPROBS and values == sorted(values, reverse=True)
        assert not compare or values == pytest.approx(
            [lp for _, lp in entry.top], abs=LOGPROB_TOLERANCE
        )
    # vLLM's block count, through its stat logger, on the server's own gauge.
    free = re.search(r"kvsparse_kv_blocks_free\{[^}]*\} ([0-9.e+]+)", metrics)
    assert free is not None and float(free[1]) > 0, metrics
    return float(free[1])


def test_completions_through_vllm_match_the_native_engine(model_source):
    """In float32 and with `--kv-cache-dtype fp8`, which the server passes on to vLLM: its KV
    memory then holds four times the blocks."""
    prompt = TaskBuilder(model_source.tokenizer, seed=0).build("passkey", 500, 1)[0].prompt_ids
    free_float32 = _serve_one(prompt, "auto")
    free_fp8 = _serve_one(prompt, "fp8")
    assert free_fp8 // free_float32 == 4


def test_a_random_weight_model_serves_through_vllm():
    """dummy:<preset> (the benchmarks' models): vLLM with random weights and no tokenizer, text
    from the preset's byte tokenizer; a stop string, which needs vLLM's tokenizer, is refused
    with the OpenAI error format."""
    engine = dataclasses.replace(ENGINE, model="dummy:tiny")
    settings = ServerSettings(
        served_model_names=["dummy:tiny"], max_model_len=1024, pools=[PoolSpec.of(SPARSE)]
    )
    app = build_standalone_app(engine, [SPARSE], settings, engine="vllm")
    prompt = list(range(3, 303))  # 300 token ids: longer than the budget of 96
    with run_server(app, None) as server:
        body = {"model": "dummy:tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        reply = httpx.post(f"{server.v1}/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        result = reply.json()
        usage = result["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (300, MAX_TOKENS), usage
        assert isinstance(result["choices"][0]["text"], str)
        refused = httpx.post(f"{server.v1}/completions", json={**body, "stop": ["x"]}, timeout=60)
        assert refused.status_code == 400, refused.text
        assert "stop strings" in refused.json()["error"]["message"]
