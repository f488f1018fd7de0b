"""The engine on CUDA: Triton kernels and CUDA graphs against the plain-torch path."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time

import pytest
import torch

from sparse_core import LLM, SamplingParams, SparsityConfig
from sparse_core.engine import model_runner
from sparse_core.kernels import REFERENCE_OPS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SPARSITY = SparsityConfig(policy="snapkv", budget=256, window=32, full_layers=3)


def generate(
    monkeypatch,
    reference: bool,
    enforce_eager: bool,
    chunked: bool = False,
    async_scheduling: bool | None = None,
    model: str = "dummy:smollm2-135m",
    sparsity: SparsityConfig = SPARSITY,
    enable_prefix_caching: bool = True,
) -> list[list[int]]:
    if reference:
        monkeypatch.setattr(model_runner, "get_ops", lambda device: REFERENCE_OPS)
    llm = LLM(
        model,
        sparsity=sparsity,
        dtype="float32",
        device="cuda",
        max_model_len=2048,
        max_num_seqs=16,
        kv_cache_memory_gb=1.0,
        enforce_eager=enforce_eager,
        # Chunked: prompts of 300-688 tokens in chunks of at most 256, beside other prompts.
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=256 if chunked else None,
        async_scheduling=async_scheduling,  # None: on, as on any GPU
        enable_prefix_caching=enable_prefix_caching,
    )
    vocab = llm.engine.model_config.vocab_size
    prompts = [[(i * 131 + j * 7) % vocab for j in range(300 + 97 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # Two prompts at once, then one per step: prefills alone and mixed with running decodes.
    engine, finished = llm.engine, {}
    engine.step_records = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        if i > 0:
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    outs = [finished[str(i)] for i in range(len(prompts))]
    budget = f"budget{sparsity.budget}"
    assert outs[-1].kv_tokens_per_group[budget] == sparsity.budget  # compression happened
    if async_scheduling is not False and not chunked:  # prompts joined steps launched ahead
        assert any(r.launched_ahead and r.num_prefill_seqs for r in engine.step_records)
    return [o.token_ids for o in outs]


def test_triton_path_matches_reference_path(monkeypatch):
    triton_tokens = generate(monkeypatch, reference=False, enforce_eager=True)
    reference_tokens = generate(monkeypatch, reference=True, enforce_eager=True)
    assert triton_tokens == reference_tokens


GEMMA3 = SparsityConfig(policy="snapkv", budget=64, window=16, full_layers=1)


@pytest.mark.parametrize("case", ["whole", "chunked", "chunked-ring"])
def test_gemma3_with_triton_and_cuda_graphs_matches_the_reference_path(monkeypatch, case):
    """Gemma 3's layout (its local layers' window of 32 sliding in prefill, chunks and the
    decode ring) through the Triton kernels and CUDA graphs, against plain torch, eager;
    chunked without the prefix cache, the local layers' chunks go round a ring."""
    args = dict(model="dummy:gemma3-tiny", sparsity=GEMMA3, chunked=case != "whole",
                enable_prefix_caching=case != "chunked-ring")  # fmt: skip
    triton_tokens = generate(monkeypatch, reference=False, enforce_eager=False, **args)
    reference_tokens = generate(monkeypatch, reference=True, enforce_eager=True, **args)
    assert triton_tokens == reference_tokens


def test_chunked_prefill_matches_whole_prompts(monkeypatch):
    """Triton path: attention over cached chunks, scoring over keys gathered from the cache."""
    assert generate(monkeypatch, False, enforce_eager=False, chunked=True) == generate(
        monkeypatch, False, enforce_eager=False
    )


def test_chunked_prefill_sizes_its_cache_by_profiling_a_last_chunk():
    """No kv_cache_memory_gb: the start-up profile runs a 256-token last chunk after 1,791
    cached tokens (compressed over all of them); a 1,500-token prompt then runs in chunks."""
    free, total = torch.cuda.mem_get_info()
    # What earlier tests of this process still hold counts against the limit: 4 GiB above it.
    limit_gb = (total - free) / 2**30 + 4
    llm = LLM(
        "dummy:smollm2-135m",
        sparsity=SPARSITY,
        device="cuda",
        gpu_memory_limit_gb=limit_gb,
        max_model_len=2048,
        enable_chunked_prefill=True,
        max_num_batched_tokens=256,
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = llm.generate([[(j * 7) % 49152 for j in range(1500)]], params)[0]
    assert len(out.token_ids) == 8
    assert out.kv_tokens_per_group["budget256"] == 256
    assert torch.cuda.max_memory_allocated() <= limit_gb * 2**30
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_async_scheduling_matches_stepping_one_at_a_time(monkeypatch):
    """Steps launched ahead, prompts joining them, against each step waiting for the last."""
    assert generate(monkeypatch, False, enforce_eager=False) == generate(
        monkeypatch, False, enforce_eager=False, async_scheduling=False
    )


def test_launching_a_prefill_step_does_not_wait_for_the_device():
    """A step that prefills is prepared and launched while the step before it still runs (async
    scheduling): no host-to-device copy in it may wait for the device to drain. Each such wait
    left the device idle for the rest of the host's preparation."""
    llm = LLM("dummy:smollm2-135m", sparsity=SPARSITY, device="cuda", max_model_len=2048,
              kv_cache_memory_gb=0.5, enforce_eager=True)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    # A prompt of the same length, which the next does not start like (a prefix cache hit would
    # prefill fewer tokens: a matmul shape of its own, whose first run waits for the device).
    engine.add_request("warm-up", list(range(2, 602)), params)
    while engine.has_unfinished:
        engine.step()
    engine.add_request("compressed", list(range(1, 601)), params)  # 600 tokens > budget 256
    step = engine.scheduler.schedule()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time ahead of the step
    start = time.perf_counter()
    engine.runner.launch(step, engine.block_manager)
    launch = time.perf_counter() - start
    torch.cuda.synchronize()
    assert launch < 0.25, f"the launch took {launch:.2f} s: it waited for the device"


def test_a_step_that_compiles_kernels_after_start_up_says_which(caplog):
    """Variants that start-up did not launch make the device wait in the middle of serving: the
    step says so, naming them, and its record holds the time. A forgotten launcher cache stands
    in for variants never launched: every kernel then goes through Triton's slow launch path,
    as a new variant's first launch does."""
    from sparse_core.kernels import launcher

    llm = LLM("dummy:smollm2-135m", sparsity=SPARSITY, device="cuda", max_model_len=1024,
              kv_cache_memory_gb=0.5, enforce_eager=True)  # fmt: skip
    engine = llm.engine
    engine.step_records = []
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("first", list(range(1, 301)), params)
    while engine.has_unfinished:
        engine.step()
    launcher._binaries.clear()
    seen = len(engine.step_records)
    engine.add_request("second", list(range(2, 302)), params)
    caplog.clear()  # the first request's own first launches (its decode kernels) came before
    with caplog.at_level("WARNING", logger="sparse_core.engine.llm_engine"):
        while engine.has_unfinished:
            engine.step()
    warnings = [r.getMessage() for r in caplog.records if "compile or load" in r.getMessage()]
    assert any("_rms_norm_kernel(" in warning for warning in warnings)
    assert engine.step_records[seen].kernel_first_launch_seconds > 0


def test_cuda_graphs_match_eager(monkeypatch):
    assert generate(monkeypatch, False, enforce_eager=False) == generate(
        monkeypatch, False, enforce_eager=True
    )


def test_building_the_model_takes_its_weights_not_a_float32_copy_first():
    """A float32 build cast to bfloat16 would peak above twice the bfloat16 weights (the
    float32 model, then each parameter's cast beside it); built in bfloat16 the peak is the
    weights plus one float32 dummy tensor being loaded (the embedding, 0.4x) and the KV cache."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    llm = LLM("dummy:smollm2-135m", device="cuda", kv_cache_memory_gb=0.05, enforce_eager=True)
    model = llm.engine.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.cuda.max_memory_allocated() - before < 2 * weights
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-weights-and-kv"])
def test_shutdown_gives_the_gpu_memory_back(fp8: bool):
    """A shut-down engine holds no GPU memory, though the LLM object is still referenced (as
    `llm` is after its `with` block): a second engine in the same process sizes its KV cache
    from what the device has free, so the first one's must be back with the device, not only
    free inside torch's allocator."""
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    fp8_args = {"quantization": "fp8", "kv_cache_dtype": "fp8"} if fp8 else {}
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with LLM("dummy:smollm2-135m", device="cuda", kv_cache_memory_gb=1.0, **fp8_args) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert torch.cuda.memory_reserved() - before > 2**30
    assert torch.cuda.memory_reserved() - before < 64 * 2**20
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-weights-and-kv"])
def test_memory_limit_caps_the_whole_process(fp8: bool):
    """In a fresh process (as a user starts one): the engine sizes its KV cache so that the
    process, CUDA context included, stays under gpu_memory_limit_gb while it runs its largest
    step (a full step of prompts beside decoding sequences), and still serves.

    The limit is the process's own (sparse_core/engine/gpu_memory.py counts this process's
    memory where NVML reports it per process, else all memory in use, which only leaves the
    child less): what this test process holds is subtracted from what the device has in use.
    The step is large (64k prompt tokens) so that its activations are large against the
    engine's start-up margins (LATE_RUNTIME_BYTES, REFIT_SLACK_BYTES).
    """
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    held_here = total - free
    limit_gb = 4
    fp8_args = ', quantization="fp8", kv_cache_dtype="fp8"' if fp8 else ""
    script = f"""
import json, logging, torch
from sparse_core import LLM, SamplingParams, SparsityConfig
logging.basicConfig(level=logging.INFO)
llm = LLM("dummy:smollm2-135m", device="cuda", gpu_memory_limit_gb={limit_gb}, max_model_len=2048,
          max_num_batched_tokens=65536, max_num_seqs=64,
          sparsity=SparsityConfig(policy="snapkv", budget=256, full_layers=3){fp8_args})
ready = torch.cuda.mem_get_info()
prompts = [[(7 * i + j) % 1000 + 1 for j in range(2000)] for i in range(32)]
outs = llm.generate(prompts + [[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
free, total = torch.cuda.mem_get_info()
blocks = llm.engine.stats().kv_blocks["full"]["total"]
kv = blocks * llm.engine.config.block_size * llm.engine.retention.bytes_per_token_per_layer * 3
llm.engine.gpu_memory.interval_s = 0.0  # measured now: what the server's gauge shows
print(json.dumps({{"used": total - free, "ready": ready[1] - ready[0], "kv": kv,
                  "peak": llm.engine.stats().gpu_memory_peak_bytes,
                  "tokens": [len(o.token_ids) for o in outs]}}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == [4] * 33
    assert result["kv"] > 2**28  # the cache took what the limit leaves, not a token amount
    # The child's own share of the device, at start and after its largest step: everything in
    # use minus what this process holds; and, as the engine reports it (the server's gauge), its
    # allocator's peak plus what it holds beside.
    log = "\n".join(line for line in proc.stderr.splitlines() if "GPU memory" in line)
    assert result["ready"] - held_here <= limit_gb * 2**30, log
    assert result["used"] - held_here <= limit_gb * 2**30, log
    assert result["kv"] < result["peak"] <= limit_gb * 2**30, log
