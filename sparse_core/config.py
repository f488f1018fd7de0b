"""User-facing configuration: sparsity policy and engine limits (vLLM vocabulary where it exists)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Policy = Literal["dense", "snapkv", "pyramid", "streamingllm", "random"]
Pooling = Literal["avg", "max", "none"]
GQAReduction = Literal["mean", "max"]
# FP8_IF_SUPPORTED, the servers' default for both: FP8 on a GPU with FP8 tensor cores, else none
# (EngineConfig.on_device).
FP8_IF_SUPPORTED = "fp8_if_supported"
Quantization = Literal["fp8", "fp8_if_supported"]
# vLLM's names: "auto" is the model's dtype; "fp8" and "fp8_e4m3" are the same e4m3 cache.
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_if_supported"]
Dtype = Literal["float32", "bfloat16", "float16"]
POLICIES: tuple[str, ...] = get_args(Policy)
POOLINGS: tuple[str, ...] = get_args(Pooling)
GQA_REDUCTIONS: tuple[str, ...] = get_args(GQAReduction)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)


def option(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    shown: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A config field and its one-line description, the help of its flag in every command
    (sparse_core/engine_args.py); `shown`: what a computed default (None) comes to, for the
    help."""
    metadata = {"help": doc} if shown is None else {"help": doc, "shown": shown}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class SparsityConfig:
    """Which tokens each layer keeps after prefill (docs/architecture.md, "The sparsity algorithm").
    Each field's one-line description (`option`) is the help of its flag.

    policy:       dense | snapkv | pyramid | streamingllm | random
    budget:       tokens kept per KV head in a sparse layer (pyramid: the mean over sparse layers)
    window:       observation window: the last `window` prompt tokens score the rest and are kept
    sinks:        the first `sinks` tokens are always kept (attention sinks)
    full_layers:  layers kept whole: the first N (int), an explicit list of indices, or "auto"
                  (the calibrated set stored for the model); None: the calibrated set where
                  the model has one, else the first 3 (logged), or none with layer_budgets
                  (whose None entries are the whole layers)
    pooling:      smoothing of scores over neighbouring tokens: avg | max | none
    kernel_size:  pooling width (odd)
    gqa_reduce:   how the query heads sharing a KV head combine their scores: mean | max
    pyramid_tiers: pyramid budgets are quantised into this many tiers (one KV pool per tier)
    seed:         seed of the `random` policy
    layer_budgets: a budget for every layer instead of one `budget` for all sparse layers: a
                  list with one entry per layer (tokens per KV head, None keeps the layer whole),
                  or "auto": the model's calibrated profile nearest `target_compression`
                  (sparse_core/profiles/layer_budgets/), whose layers keep a share of each
                  prompt (LayerGroup.ratio). Layers with equal budgets share one KV pool.
    target_compression: the effective compression over all layers that layer_budgets="auto"
                  asks for (prompt token-layers / kept token-layers, at every prompt length)
    decode_eviction: a sparse layer never holds more than its budget, generated tokens
                  included: the prefill keeps its budget less `decode_window` tokens, and the
                  tokens fed after it take the rest in turn, each replacing the oldest of them
                  once it is full. Off: every generated token is kept (the layer grows by one
                  per step).
    decode_window: with decode_eviction, the recent tokens a sparse layer keeps of those fed
                  after the prefill (at most its budget less window, sinks and one, so that
                  the prompt keeps those and one scored token)
    """

    policy: Policy = option("snapkv", "which tokens the sparse layers keep")
    budget: int = option(512, "tokens kept per KV head in a sparse layer (pyramid: the mean)")
    window: int = option(32, "the last prompt tokens, which score the rest and are kept")
    sinks: int = option(4, "the first prompt tokens, always kept (attention sinks)")
    full_layers: int | list[int] | str | None = option(
        None,
        "layers kept whole: the first N, a comma-separated list of indices, or auto (the "
        "model's calibrated set)",
        shown="the model's calibrated set where it has one, else the first 3; none with layer "
        "budgets",
    )
    pooling: Pooling = option("avg", "smoothing of the scores over neighbouring tokens")
    kernel_size: int = option(7, "width of the pooling (odd)")
    gqa_reduce: GQAReduction = option("mean", "how query heads sharing a KV head combine scores")
    pyramid_tiers: int = option(4, "pyramid: budgets quantised into this many tiers (KV pools)")
    seed: int = option(0, "seed of the random policy")
    layer_budgets: str | list[int | None] | None = option(
        None,
        "a budget per layer: auto (the model's calibrated profile for the target compression) "
        "or a comma-separated list, none for a whole layer",
    )
    target_compression: float | None = option(
        None, "with layer budgets auto: the effective compression over all layers, e.g. 4"
    )

    decode_eviction: bool = option(
        False, "sparse layers hold at most their budget while decoding (the recent tokens rotate)"
    )
    decode_window: int = option(
        128, "with decode eviction: the recent generated tokens a sparse layer keeps"
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown sparsity policy {self.policy!r}; expected one of {POLICIES}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; expected one of {POOLINGS}")
        if self.gqa_reduce not in GQA_REDUCTIONS:
            raise ValueError(
                f"unknown gqa_reduce {self.gqa_reduce!r}; expected one of {GQA_REDUCTIONS}"
            )
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd number, got {self.kernel_size}")
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.pyramid_tiers < 1:
            raise ValueError(f"pyramid_tiers must be at least 1, got {self.pyramid_tiers}")
        if self.decode_window < 1:
            raise ValueError(f"decode_window must be at least 1, got {self.decode_window}")
        if self.decode_eviction and self.policy == "dense":
            raise ValueError(
                "decode_eviction bounds what the sparse layers hold, and the dense policy has "
                "none; choose a compressing policy (snapkv, pyramid, ...) or leave it off"
            )
        if self.policy != "dense" and self.budget <= self.window + self.sinks:
            raise ValueError(
                f"budget ({self.budget}) must be greater than window ({self.window}) + sinks "
                f"({self.sinks}): the budget holds the window, the sinks and the selected tokens"
            )
        self._check_full_layers()
        self._check_layer_budgets()

    def _check_full_layers(self) -> None:
        fl = self.full_layers
        if fl is None or fl == "auto":
            return
        if isinstance(fl, bool) or not isinstance(fl, int | list | tuple):
            raise ValueError(f"full_layers must be an int, a list of ints or 'auto', got {fl!r}")
        if isinstance(fl, int):
            if fl < 0:
                raise ValueError(f"full_layers must be >= 0, got {fl}")
            return
        self.full_layers = list(fl)
        if len(set(self.full_layers)) != len(self.full_layers):
            raise ValueError(f"full_layers has duplicate layer indices: {self.full_layers}")
        if any(not isinstance(i, int) or i < 0 for i in self.full_layers):
            raise ValueError(f"full_layers indices must be ints >= 0: {self.full_layers}")

    def _check_layer_budgets(self) -> None:
        spec, ratio = self.layer_budgets, self.target_compression
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, int | float) or ratio < 1:
                raise ValueError(
                    f"target_compression must be a number >= 1 (kept tokens never exceed the "
                    f"prompt), got {ratio!r}"
                )
            if spec != "auto":
                raise ValueError(
                    "target_compression is the compression layer_budgets='auto' asks for; "
                    "set layer_budgets='auto' with it (an explicit list sets its own compression)"
                )
        if spec is None:
            return
        if isinstance(spec, str):
            if spec != "auto":
                raise ValueError(f"layer_budgets must be 'auto' or a list, got {spec!r}")
            if ratio is None:
                raise ValueError(
                    "layer_budgets='auto' needs target_compression (e.g. 4.0): the profile is "
                    "chosen for that effective compression"
                )
        elif isinstance(spec, list | tuple):
            self.layer_budgets = spec = list(spec)
            floor = self.window + self.sinks
            bad = [b for b in spec if b is not None and (not _is_int(b) or b <= floor)]
            if bad or not spec:
                raise ValueError(
                    f"layer_budgets entries must be None (whole layer) or ints greater than "
                    f"window ({self.window}) + sinks ({self.sinks}); got {bad or 'an empty list'}"
                )
        else:
            raise ValueError(f"layer_budgets must be 'auto' or a list, got {spec!r}")
        if self.policy == "pyramid":
            raise ValueError(
                "layer_budgets and policy 'pyramid' both set per-layer budgets; use snapkv (or "
                "streamingllm, random) with layer_budgets"
            )
        if self.full_layers is not None:
            raise ValueError(
                "layer_budgets says which layers stay whole (its None entries); leave "
                f"full_layers unset with it, got full_layers={self.full_layers!r}"
            )

    @property
    def compresses(self) -> bool:
        return self.policy != "dense"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SparsityConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sparsity option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# Tokens per KV page when EngineConfig.block_size is None. On CUDA a page is one key tile of the
# paged decode kernel (128 keys at head dims up to 128), which then finds a tile's rows from one
# page number instead of one per token, a faster read (docs/benchmarks.md, "Kernels and the
# decode roofline"). The cost is memory: on
# average half a page per sequence and layer group stays unused.
CUDA_BLOCK_SIZE = 128
DEFAULT_BLOCK_SIZE = 16


@dataclass
class EngineConfig:
    """Everything the engine needs besides the sparsity policy. Each field's one-line
    description (`option`) is the help of its flag (sparse_core/engine_args.py).

    block_size: tokens per KV cache page (block); None: CUDA_BLOCK_SIZE (128) on CUDA devices,
      DEFAULT_BLOCK_SIZE (16) elsewhere. Any size works; on CUDA a multiple of 128 keeps the
      decode kernel's faster path.
    kv_cache_memory_gb: KV cache in total (all layer groups), in GiB; None = what is left on the
      GPU under `gpu_memory_utilization` (and `gpu_memory_limit_gb`) after weights, activations
      and CUDA graphs; 2 GiB on CPU.
    gpu_memory_limit_gb: a hard cap on the engine's GPU memory in GiB, e.g. 24 to make a large
      GPU stand in for an RTX 4090. Memory that other processes hold on the same GPU when the
      engine starts counts against it, as it would on the smaller card.
    expected_input_len: the typical prompt: a server's step size (max_num_batched_tokens),
      the length async scheduling takes for the next prompt to come, and the length
      layer_budgets="auto" sizes budgets for in vLLM's plugin.
    max_num_batched_tokens: prompt tokens prefilled per step (the running sequences' decode
      tokens join them in the same forward pass). Without chunked prefill prompts are prefilled
      whole: a prompt longer than this runs alone, in a step that admits no other (vLLM refuses
      a value below max_model_len there instead). None: the larger of max_model_len and 8192;
      a server's default is expected_input_len, one typical prompt per step
      (service/settings.py).
    enable_chunked_prefill: a prompt that does not fit what is left of a step is prefilled in
      chunks over the next steps, so that running sequences keep decoding while it is. Until its
      last chunk a chunked prompt holds blocks for all its tokens in every layer group (sparse
      groups shrink to their budget after it).
    enable_prefix_caching: a prompt's full blocks of KV stay in the KV cache after its
      prefill, in every layer group (compressing groups hold the whole prefill while it runs,
      and write the tokens they keep to blocks of their own), as cached blocks that count as
      free: allocation evicts them, least recently used first. A prompt whose first full
      blocks are cached in every group prefills only the rest: whole groups share the cached
      blocks, compressing groups score the whole prompt with its own observation window and
      keep their own selection (sparse_core/cache/block_manager.py). A prefill for which the
      groups lack the room to cache runs as without the cache.
    space_admissions: while sequences decode, a step that ended a prompt's prefill is followed
      by one that admits none (its decode rows alone, a short decode-only step) before the
      next prompt joins; a prompt with a single token to generate does not
      count (it never decodes), nor do the chunks of a chunked prompt before its last. Prompts
      admitted in consecutive steps produce their tokens in lockstep and, at equal lengths,
      finish in consecutive steps, faster than their clients can send the next requests (a
      closed loop, a chat's next turn): those then queue behind each other for the rest of the
      run, one long prefill step each. Spacing the admissions of a burst costs one decode-only
      step per prompt admitted behind another, and takes a closed loop's TTFT p50 down by about
      one prefill (docs/benchmarks.md, "Time to first token"). Off by default; `kvsparse
      serve` turns it on.
    max_prefill_graph_tokens: steps that prefill with up to this many tokens (decode rows
      included) run everything but their attention from CUDA graphs captured at start-up, in
      buckets of 64 tokens; longer steps, whose device time hides their launches, run eagerly. The
      graphs' memory (docs/benchmarks.md, "Engine internals") comes out of the KV cache
      when that is sized from GPU memory (on top of kv_cache_memory_gb otherwise). None: with
      chunked prefill and max_num_batched_tokens up to 2048, every step (its prompt tokens plus
      max_num_seqs decode rows), else 2048; without chunked prefill, 512 (steps of short
      prompts). 0 turns these graphs off; enforce_eager turns off every graph.
    async_scheduling: while a step runs on the device, the host launches the next one (its
      decode rows' input tokens are the running step's sampled ids, still on the device; the
      waiting prompts that fit join it), then reads the running step's tokens and builds its
      outputs: the device no longer waits for the host between steps. A sequence that a stop
      token or string ends has one more token computed and dropped (its row still draws from
      the engine's generator when sampled, so requests without a `seed` may sample differently
      than with this off; seeded ones do not). A step that would preempt, follows a prompt's
      chunk or a forced prompt token, or comes right after a step that finished a request
      (unless a new request could not join it anyway: the waiting prompts take every free
      sequence slot, or leave no room for a prompt of expected_input_len tokens, or for a
      chunk of it with chunked prefill) waits for the tokens as before.
      None: on for CUDA devices (on a CPU the launch is the computation: nothing to overlap);
      always off under tensor parallelism.
    tensor_parallel_size: ranks (GPUs; processes on CPU) that split each layer's heads, MLP and
      vocabulary; on CUDA rank r runs on GPU `device index + r`. Memory settings
      (kv_cache_memory_gb, gpu_memory_*) are per rank.
    quantization: None (weights in `dtype`) or "fp8": the linear layers' weights in FP8 e4m3
      with one scale per output channel, quantized at load, and activations quantized per token
      on the fly (vLLM's `--quantization fp8`); the embeddings and the LM head stay in `dtype`.
      Needs FP8 tensor cores on a GPU (compute capability 8.9+: Ada such as the RTX 4090,
      Hopper); on a CPU it runs through the float32 reference (sparse_core/kernels/fp8.py).
      A pre-quantized compressed-tensors FP8-Dynamic checkpoint sets "fp8" when this is None
      and its stored FP8 weights and scales are loaded as they are (models/prequantized.py).
      "fp8_if_supported" (the default of `kvsparse serve` and of a Serve config) is "fp8" on a
      GPU with FP8 tensor cores and None elsewhere (on a CPU, on an older GPU), resolved where
      the engine starts (`on_device`).
    kv_cache_dtype: "auto" (the KV cache in `dtype`) or "fp8" / "fp8_e4m3" (vLLM's
      `--kv-cache-dtype fp8`): every layer group's pages hold e4m3, half the bytes of bf16, with
      one scale for K and one for V per layer (sparse_core/kernels/fp8.py, KVScales). Tokens are
      quantized as they are stored (compress-on-write stores the kept ones), and decode reads
      them back; prefill attention and scoring use the step's own keys and values, unquantized.
      Usable with or without `quantization`; on a GPU it needs compute capability 8.9+.
      "fp8_if_supported" (the servers' default) is "fp8" where `quantization`'s is, else "auto".
    step_log: a file to append every step to, one JSON line each (sparse_core/engine/step_log.py):
      when it ended (Unix time), the engine's policy and budget, what it ran, its wall time and
      host launch time, whether it was launched ahead, and the host time it spent in kernels'
      first launches. None: no log.
    """

    model: str = option(
        "smollm2-135m-instruct",
        "built-in alias, Hugging Face directory or repository id (org/name), .gguf file or "
        "dummy:<preset>",
    )
    max_num_seqs: int = option(64, "sequences running at once")
    max_model_len: int = option(8192, "prompt + output tokens of a sequence")
    max_num_batched_tokens: int | None = option(
        None,
        "prompt tokens prefilled per step (without chunked prefill a longer prompt runs alone)",
        shown="the larger of max_model_len and 8192",
    )
    enable_chunked_prefill: bool = option(
        False, "prefill a prompt that does not fit a step in chunks over several steps"
    )
    enable_prefix_caching: bool = option(
        True, "keep prompts' full KV blocks after prefill and start later prefills after them"
    )
    space_admissions: bool = option(
        False,
        "while sequences decode, follow a step that ended a prefill with one admitting no prompt",
    )
    block_size: int | None = option(
        None, "tokens per KV cache page", shown="128 on CUDA, 16 elsewhere"
    )
    kv_cache_memory_gb: float | None = option(
        None,
        "KV cache in GiB, all layer groups",
        shown="what the GPU has left under the memory settings; 2 on CPU",
    )
    gpu_memory_utilization: float = option(0.9, "fraction of the GPU's memory the engine may use")
    gpu_memory_limit_gb: float | None = option(
        None, "hard cap on the engine's GPU memory in GiB, e.g. 24 to emulate an RTX 4090"
    )
    expected_input_len: int = option(
        4000, "typical prompt tokens: a server's prompt tokens per step"
    )
    device: str | None = option(None, "cpu, cuda, cuda:1", shown="cuda if present")
    dtype: Dtype | None = option(
        None, "the model's dtype", shown="bfloat16 on CUDA, float32 elsewhere"
    )
    seed: int = option(0, "seed of the engine: random weights, sampling without a request seed")
    enforce_eager: bool = option(False, "no CUDA graphs")
    max_prefill_graph_tokens: int | None = option(
        None,
        "steps of up to this many tokens run all but attention from CUDA graphs; 0: never",
        shown="with chunked prefill every step up to 2048 tokens, else 512",
    )
    async_scheduling: bool | None = option(
        None,
        "launch each step before the previous one's tokens reach the host",
        shown="on CUDA devices, without tensor parallelism",
    )
    tensor_parallel_size: int = option(
        1, "GPUs (processes on CPU) that split every layer's heads; KV heads must divide by it"
    )
    quantization: Quantization | None = option(
        None,
        "fp8: linear layers' weights and activations in FP8 e4m3 (compute capability 8.9+); "
        "a compressed-tensors FP8-Dynamic checkpoint sets it itself",
        shown="none, the weights in dtype",
    )
    kv_cache_dtype: KVCacheDtype = option(
        "auto", "auto: the model's dtype; fp8 (= fp8_e4m3): e4m3 pages, half the bytes of bf16"
    )
    step_log: str | None = option(None, "append every engine step to this file as a JSON line")
    hf_overrides: dict[str, Any] = option(
        doc="model config fields to override, as a JSON object", factory=dict
    )

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "block_size", "tensor_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"unknown quantization {self.quantization!r}; expected one of {QUANTIZATIONS} "
                f"(or None for weights in the model's dtype)"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES}"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(self.max_model_len, 8192)
        if self.max_prefill_graph_tokens is None:
            step = self.max_num_batched_tokens
            if not self.enable_chunked_prefill:
                self.max_prefill_graph_tokens = 512
            else:
                self.max_prefill_graph_tokens = step + self.max_num_seqs if step <= 2048 else 2048
        if self.max_prefill_graph_tokens < 0:
            raise ValueError(
                f"max_prefill_graph_tokens must be at least 0, got {self.max_prefill_graph_tokens}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def longest_whole_prefill(self) -> int:
        """Prefill tokens a step may compute for one prompt: a longer prefill goes in chunks
        (with chunked prefill); without, every prompt runs whole, alone if it must."""
        assert self.max_num_batched_tokens is not None
        if self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)

    @property
    def fp8_kv_cache(self) -> bool:
        assert self.kv_cache_dtype != FP8_IF_SUPPORTED, "resolved by on_device"
        return self.kv_cache_dtype != "auto"

    def on_device(self, device_type: str, supports_fp8: bool) -> EngineConfig:
        """This config with the defaults that depend on the device filled in: the block size
        for `device_type` ("cuda", "cpu"), and "fp8_if_supported" as FP8 when the device has
        FP8 tensor cores (`supports_fp8`), else as none."""
        changes: dict[str, Any] = {}
        if self.block_size is None:
            changes["block_size"] = CUDA_BLOCK_SIZE if device_type == "cuda" else DEFAULT_BLOCK_SIZE
        if self.quantization == FP8_IF_SUPPORTED:
            changes["quantization"] = "fp8" if supports_fp8 else None
        if self.kv_cache_dtype == FP8_IF_SUPPORTED:
            changes["kv_cache_dtype"] = "fp8" if supports_fp8 else "auto"
        return dataclasses.replace(self, **changes) if changes else self
