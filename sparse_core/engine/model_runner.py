"""Owns the model and the KV caches; turns a scheduled batch into tensors, runs it, samples.

Under tensor parallelism every rank has a ModelRunner over its share of the model. Rank 0's
prepares each step's host-side inputs (a StepBatch, built by engine/batch_builder.py), hands
them to the worker ranks, and every rank runs `execute`; only rank 0 samples.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import math
import time
from collections.abc import Iterator

import torch

from sparse_core.cache.block_manager import BlockManager
from sparse_core.cache.retention import KVRetention, cdiv
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.distributed.every_rank import RankGroup, every_rank
from sparse_core.distributed.layers import quantize_at_load
from sparse_core.distributed.parallel_state import get_tp_rank, get_tp_size, rank_device
from sparse_core.engine.batch_builder import BatchBuilder, CachedChunks, PrefillBatch, StepBatch
from sparse_core.engine.cuda_graphs import DecodeBatch, DecodeGraphs
from sparse_core.engine.device import resolve_device, resolve_dtype
from sparse_core.engine.device_tokens import DeviceTokens
from sparse_core.engine.gpu_memory import limit_allocator
from sparse_core.engine.piecewise_graphs import PiecewiseGraphs
from sparse_core.engine.sampler import sample, sampled_logprobs
from sparse_core.engine.scheduler import ScheduledStep
from sparse_core.kernels import get_ops
from sparse_core.models.attention import (
    ChunkContext,
    CompressJobs,
    DecodeGroupMetadata,
    DecodeMetadata,
    PrefillGroupMetadata,
    PrefillMetadata,
    StepMetadata,
)
from sparse_core.models.dummy import dummy_weights
from sparse_core.models.llama import LlamaForCausalLM
from sparse_core.models.loader import ModelSource
from sparse_core.models.quantization import check_fp8_device
from sparse_core.selection import PromptBatch, SelectionPolicy, selection_policy
from sparse_core.transfers import PendingTokens, to_device

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype, for the whole process (engines are built one at a time)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        sparsity: SparsityConfig,
        source: ModelSource,
        workers: RankGroup | None = None,
    ) -> None:
        self.config = config
        self.workers = workers  # rank 0 of a tensor-parallel group: the other ranks
        self.device = rank_device(resolve_device(config.device), get_tp_rank(), get_tp_size())
        # A cap that an engine before this one in the process left does not bind this one.
        limit_allocator(self.device, None)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        model_config = source.config
        if config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({model_config.max_position_embeddings})"
            )
        prequantized = model_config.checkpoint_quantization
        if config.quantization == "fp8":
            setting = "quantization='fp8'"
            if prequantized is not None:
                setting = f"the {prequantized.describe()} checkpoint ({setting})"
            check_fp8_device(self.device, setting)
        if config.fp8_kv_cache:
            check_fp8_device(self.device, f"kv_cache_dtype={config.kv_cache_dtype!r}")
        self.retention = KVRetention.build(model_config, config, sparsity, self.dtype)
        self.batch_builder = BatchBuilder(self.retention)
        torch.manual_seed(config.seed)
        # Built in its dtype where it runs: building in float32 and casting would first take
        # twice the weights' memory (30 GiB for an 8B model, more than a 24 GB card has); with
        # quantization="fp8" its projections are FP8 from the start, each quantized as it loads.
        ops = get_ops(self.device)
        quantize = config.quantization == "fp8" and prequantized is None
        with torch.device(self.device), _default_dtype(self.dtype), quantize_at_load(quantize):
            self.model = LlamaForCausalLM(
                model_config, self.retention.plan, ops, config.max_model_len
            )
        if source.weights is not None:
            self.model.load_weights(source.weights)
        else:
            self.model.load_weights(dummy_weights(model_config, config.seed, self.device))
        if self.device.type == "cuda":
            # What loading left in the allocator's cache (a pre-quantized checkpoint's bf16
            # projections built first, the full tensors read) goes back.
            torch.cuda.empty_cache()
        self.model.eval()
        self.tokens = DeviceTokens(config.max_num_seqs, self.device)
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PiecewiseGraphs | None = None
        self.generator = torch.Generator().manual_seed(config.seed)
        # The rank's selection policy, and one for the start-up profile, whose draws then leave
        # the random policy's stream where serving starts it.
        self.selection = selection_policy(sparsity, ops, self.model.kv_heads)
        self.profile_selection = selection_policy(sparsity, ops, self.model.kv_heads)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of the model's without tensor parallelism)."""
        return self.model.attention_layers[0].num_kv_heads

    # The methods marked @every_rank run on every rank of a tensor-parallel engine: on rank 0
    # each first sends itself to the other ranks (sparse_core/distributed/every_rank.py).

    @every_rank
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """K and V caches of `num_blocks` blocks in each of a block's layer slots; every KV
        group's i-th layer uses slot i, so a block id names the same memory in every group
        (KVRetention)."""
        retention = self.retention
        shape = (
            2,
            retention.layers_per_block,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.model.config.head_dim,
        )
        cache = torch.zeros(shape, dtype=retention.kv_dtype, device=self.device)
        attns = self.model.attention_layers
        for group in retention.plan.groups:
            for i, layer in enumerate(group.layers):
                attns[layer].k_cache, attns[layer].v_cache = cache[0, i], cache[1, i]

    @every_rank
    def cap_allocator(self, max_bytes: int) -> None:
        """Torch's allocator on this rank's GPU holds at most `max_bytes`."""
        limit_allocator(self.device, max_bytes)

    @every_rank
    def release_kv_cache(self) -> None:
        """Drop the KV cache and the decode graphs that read it, back to the device (before
        allocating it again at another size)."""
        self._free_kv_cache()

    def close(self) -> None:
        """Give this rank's device memory back once its engine is shut down: the weights, the
        graphs and the KV cache (the other ranks' processes have ended by then)."""
        self.prefill_graphs = None
        self.model.to("meta")
        self._free_kv_cache()

    def _free_kv_cache(self) -> None:
        self.decode_graphs = None
        for attn in self.model.attention_layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def launch(self, step: ScheduledStep, block_manager: BlockManager) -> torch.Tensor:
        """Prepare the step's inputs and enqueue its forward pass; its logits (on the device,
        possibly not computed yet), in `step.seqs` order."""
        return self.execute(self.batch_builder.build(step, block_manager))

    @torch.inference_mode()
    def sample_tokens(
        self, step: ScheduledStep, logits: torch.Tensor, wanted: list[bool]
    ) -> PendingTokens:
        """Queue the choice of every sequence's next token, in `step.seqs` order, and the logprobs
        of the rows that ask for them; rows not `wanted` (a forced token's or an early chunk's
        prediction) draw nothing. The tokens go to their sequences' entries of the device token
        pool too, where a step launched before they reach the host reads them."""
        tokens = sample(logits, step.seqs, self.generator, wanted, self.tokens.next_ids)
        self.tokens.record(self._tensor([seq.table_row for seq in step.seqs]), tokens)
        return PendingTokens(tokens, sampled_logprobs(logits, tokens, step.seqs, wanted))

    @every_rank
    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Every rank's part of a step: the forward pass; logits [B, V] (full vocabulary), the
        prompts' last tokens first, then the decoded tokens."""
        if batch.prefill is None and self.decode_graphs is not None:
            return self.decode_graphs.run(batch.decode)
        return self._forward(batch, self.selection)

    def _forward(self, batch: StepBatch, selection: SelectionPolicy | None) -> torch.Tensor:
        """`selection`: the policy that chooses the tokens compressing groups keep."""
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        prefill = decode = None
        if batch.prefill is not None:
            input_ids += batch.prefill.input_ids
            positions += batch.prefill.positions
            rows += [end - 1 for end in batch.prefill.cu_seqlens[1:]]
            prefill = self._prefill_metadata(batch.prefill, selection)
        if batch.decode is not None:
            rows += range(len(positions), len(positions) + len(batch.decode.positions))
            positions += batch.decode.positions
            decode = self._decode_metadata(batch.decode)
        token_ids = self._tensor(input_ids)
        if batch.decode is not None:
            decode_ids = self.tokens.inputs(
                self._tensor(batch.decode.input_ids), self._tensor(batch.decode.table_rows)
            )
            token_ids = torch.cat([token_ids, decode_ids]) if input_ids else decode_ids
        meta = StepMetadata(prefill, decode)
        # A decode-only step's rows are all its tokens.
        logit_rows = self._tensor(rows) if batch.prefill is not None else None
        graphs = self.prefill_graphs
        if graphs is not None and len(positions) <= graphs.max_tokens:
            hidden = graphs.forward(token_ids, self._tensor(positions), meta)
            if logit_rows is not None:
                hidden = hidden[logit_rows]
        else:
            hidden = self.model(token_ids, self._tensor(positions), meta, rows=logit_rows)
        return self.model.compute_logits(hidden)

    def _prefill_metadata(
        self, batch: PrefillBatch, selection: SelectionPolicy | None
    ) -> PrefillMetadata:
        cached = batch.cached
        cached_slots = [None] * len(self.retention.groups)
        if cached is not None:
            cached_slots = self._group_rows(cached.cached_slots)
        groups = [
            PrefillGroupMetadata(
                slot_mapping=slots,
                compress=CompressJobs(
                    PromptBatch.from_bounds(bounds, kept, self.device, query_ends),
                    self._tensor(kept_slots),
                ),
                cached_slots=group_cached_slots,
            )
            for slots, bounds, kept, query_ends, kept_slots, group_cached_slots in (
                zip(
                    self._group_rows(batch.slot_mappings),
                    batch.compress_bounds,
                    batch.compress_kept,
                    batch.compress_query_ends,
                    batch.compress_slots,
                    cached_slots,
                    strict=True,
                )
            )
        ]
        context = None
        if cached is not None:
            context = ChunkContext(
                cu_seqlens_k=self._tensor(cached.cu_seqlens_k),
                num_keys=cached.cu_seqlens_k[-1],
                new_rows=self._tensor(cached.new_rows),
                cached_rows=self._tensor(cached.cached_rows),
            )
        return PrefillMetadata(
            num_tokens=len(batch.input_ids),
            cu_seqlens=self._tensor(batch.cu_seqlens),
            max_seqlen=batch.max_seqlen,
            groups=groups,
            context=context,
            selection=selection,
        )

    def _decode_metadata(self, batch: DecodeBatch) -> DecodeMetadata:
        longest = batch.context_lens.max(dim=1).values.tolist()
        return DecodeMetadata(
            [
                DecodeGroupMetadata(slots, tables, lens, most)
                for slots, tables, lens, most in zip(
                    self._group_rows(batch.slots),
                    self._group_rows(batch.block_tables),
                    self._group_rows(batch.context_lens),
                    longest,
                    strict=True,
                )
            ]
        )

    def _tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def _group_rows(self, values: torch.Tensor) -> list[torch.Tensor]:
        """A host tensor [groups, ...] in one copy to the device, as each group's part. Each part
        starts 16-byte aligned (padded apart): Triton specialises a kernel on its pointers'
        alignment, and a part that starts elsewhere compiles another variant in the middle of
        serving (0.7 s for the decode kernel on an H100)."""
        groups, shape = values.shape[0], values.shape[1:]
        n = math.prod(shape)
        per_16_bytes = 16 // values.element_size()
        padded = torch.zeros((groups, cdiv(n, per_16_bytes) * per_16_bytes), dtype=values.dtype)
        padded[:, :n] = values.reshape(groups, n)
        return [row[:n].view(shape) for row in to_device(padded, values.dtype, self.device)]

    # -- GPU start-up ---------------------------------------------------------------------------

    @every_rank
    @torch.inference_mode()
    def profile_activation_bytes(self) -> int:
        """Peak memory the largest step needs above what the allocator holds now (CUDA only).

        Runs a step's most prompt tokens (`EngineConfig.longest_whole_prefill`: without chunked
        prefill, at least one longest prompt, which runs alone), in prompts of max_model_len
        tokens, together with
        max_num_seqs decoding rows, every slot at -1 so nothing is cached; the caches are
        placeholders of one block. Sparse groups compress the prompts as in serving, so the
        scoring buffers are counted and the scoring and compaction kernels compiled now rather
        than on the first request.
        """
        cfg, config = self.model.config, self.config
        placeholder = torch.zeros(
            (2, 1, self.block_size, self.num_kv_heads, cfg.head_dim),
            dtype=self.retention.kv_dtype,
            device=self.device,
        )
        for attn in self.model.attention_layers:
            attn.k_cache, attn.v_cache = placeholder[0], placeholder[1]
        total = config.longest_whole_prefill
        lens = [config.max_model_len] * (total // config.max_model_len)
        if total % config.max_model_len:
            lens.append(total % config.max_model_len)
        cu_seqlens = [0]
        for n in lens:
            cu_seqlens.append(cu_seqlens[-1] + n)
        num_groups, rows = len(self.retention.groups), config.max_num_seqs
        # With chunked prefill and steps shorter than a prompt, the largest step is the last
        # chunk of a longest prompt: its attention and scoring read every token, the cached
        # ones gathered from the cache (here all from slot 0 of the placeholder).
        context = 0
        cached = None
        if config.enable_chunked_prefill and total < config.max_model_len - 1:
            context = config.max_model_len - 1 - total
            cached = CachedChunks(
                cu_seqlens_k=[0, context + total],
                new_rows=torch.arange(context, context + total),
                cached_rows=torch.arange(context),
                cached_slots=torch.zeros((num_groups, context), dtype=torch.int64),
            )
        compress_bounds: list[list[tuple[int, int]]] = [[] for _ in range(num_groups)]
        compress_kept: list[list[int]] = [[] for _ in range(num_groups)]
        compress_query_ends: list[list[int]] = [[] for _ in range(num_groups)]
        compress_slots: list[list[int]] = [[] for _ in range(num_groups)]
        for g, group in enumerate(self.retention.groups):
            for start, end in itertools.pairwise(cu_seqlens):
                num_keys = context + end - start  # context: only with a single prompt
                if group.compresses(num_keys):
                    kept = group.tokens_after_prefill(num_keys)
                    compress_bounds[g].append((start, start + num_keys))
                    compress_kept[g].append(kept)
                    compress_query_ends[g].append(end)
                    compress_slots[g] += [-1] * kept
        prefill = PrefillBatch(
            input_ids=torch.randint(0, cfg.vocab_size, (total,)).tolist(),
            positions=[context + p for n in lens for p in range(n)],
            cu_seqlens=cu_seqlens,
            max_seqlen=max(lens),
            slot_mappings=torch.full((num_groups, total), -1),
            compress_bounds=compress_bounds,
            compress_kept=compress_kept,
            compress_query_ends=compress_query_ends,
            compress_slots=[torch.tensor(slots, dtype=torch.int64) for slots in compress_slots],
            cached=cached,
        )
        decode = DecodeBatch(
            input_ids=torch.zeros(rows, dtype=torch.int64),
            table_rows=torch.arange(rows),
            positions=[0] * rows,
            slots=torch.full((num_groups, rows), -1),
            block_tables=torch.zeros((num_groups, rows, 1), dtype=torch.int32),
            context_lens=torch.ones((num_groups, rows), dtype=torch.int32),
        )
        # Counted as what the step makes the allocator reserve, not only what it allocates: the
        # allocator is capped at its reserved bytes (kv_cache_sizing.fit_kv_cache), and a step's
        # tensors take whole segments, rounded up and partly unusable once fragmented.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        self._forward(StepBatch(prefill, decode), self.profile_selection)
        torch.cuda.synchronize(self.device)
        return max(
            torch.cuda.max_memory_allocated(self.device) - allocated,
            torch.cuda.max_memory_reserved(self.device) - reserved,
        )

    def _uses_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager

    @every_rank
    @torch.inference_mode()
    def capture_prefill_graphs(self) -> int:
        """Capture the pieces of steps that prefill (before the KV caches exist: the pieces do
        not read them, and what their memory pool takes can then be left out of the caches);
        returns the device memory that took (0 when they are off)."""
        config = self.config
        # No step holds more than a full step of prompt tokens and a decode row per sequence.
        tokens = min(
            config.max_prefill_graph_tokens, config.max_num_batched_tokens + config.max_num_seqs
        )
        if not self._uses_graphs() or tokens == 0:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as capturing does: the difference is then the graphs' alone
        before, start = torch.cuda.memory_reserved(self.device), time.perf_counter()
        self.prefill_graphs = PiecewiseGraphs(self.model, tokens, self.device)
        self.prefill_graphs.capture()
        taken = torch.cuda.memory_reserved(self.device) - before
        logger.info(
            "captured prefill graphs for %d token counts up to %d in %.1f s (%.2f GiB)",
            len(self.prefill_graphs.buckets),
            tokens,
            time.perf_counter() - start,
            taken / 2**30,
        )
        return taken

    @every_rank
    def capture_decode_graphs(self) -> None:
        """After the KV caches exist: capture decode graphs, unless eager mode or not on CUDA."""
        if not self._uses_graphs():
            return
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.tokens,
            len(self.retention.groups),
            self.config.max_num_seqs,
            cdiv(self.config.max_model_len, self.block_size),
            self.config.max_model_len,
            self.device,
        )
        self.decode_graphs.capture()
