"""The synchronous engine: requests in, one `step()` at a time, outputs out."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparse_core.cache.block_manager import BlockManager
from sparse_core.config import EngineConfig, SparsityConfig
from sparse_core.distributed.driver import TensorParallelWorkers
from sparse_core.distributed.parallel_state import check_tp_divisibility
from sparse_core.engine.device import config_on_device
from sparse_core.engine.gpu_memory import PeakGpuMemoryMeter
from sparse_core.engine.kv_cache_sizing import start_kv_cache
from sparse_core.engine.model_runner import ModelRunner
from sparse_core.engine.output_processor import OutputProcessor
from sparse_core.engine.request_checker import RequestChecker
from sparse_core.engine.scheduler import ScheduledStep, Scheduler
from sparse_core.engine.step_log import StepLog, StepRecord
from sparse_core.kernels import kernel_first_launch_count, kernel_first_launches
from sparse_core.models.loader import ModelSource, load_model_source
from sparse_core.models.prequantized import resolve_quantization
from sparse_core.outputs import RequestOutput
from sparse_core.sampling_params import SamplingParams
from sparse_core.sequence import Sequence
from sparse_core.transfers import PendingTokens

if TYPE_CHECKING:
    from sparse_core.kernels.launcher import FirstLaunch  # imports Triton

logger = logging.getLogger(__name__)

# A sequence in this many failed steps fails, suspect or not (`recover_from_failed_step`).
MAX_FAILED_STEPS = 3


@dataclass
class _Flight:
    """A launched step whose sampled tokens the host has not read yet."""

    step: ScheduledStep
    wanted: list[bool]  # per row: its token is an output (not a forced token's or a chunk's)
    tokens: PendingTokens
    start: float  # monotonic: when the host began preparing it
    launched: float  # when its forward pass was enqueued
    record: StepRecord | None  # when the engine records steps


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    # Layer group -> {"total", "used", "free", "cached"}: the blocks its KV groups use and
    # cache, and the pool's total and free blocks, which every group shares.
    kv_blocks: dict[str, dict[str, int]]
    # This process's peak on the GPU since it started, CUDA context included; None off CUDA.
    gpu_memory_peak_bytes: int | None = None
    # Prefill tokens admissions asked for, and found in the prefix cache, since the start.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def kv_used_fraction(self) -> float:
        """KV blocks in use, of all the pool's."""
        groups = self.kv_blocks.values()
        total = max((g["total"] for g in groups), default=0)
        return sum(g["used"] for g in groups) / total if total else 0.0


class LLMEngine:
    """With tensor_parallel_size > 1 the engine starts worker processes (ranks 1..tp-1); stop
    them with `shutdown()` or `with LLMEngine(...) as engine:` (garbage collection and
    interpreter exit also stop them)."""

    def __init__(
        self,
        config: EngineConfig,
        sparsity: SparsityConfig,
        model_source: ModelSource | None = None,
    ) -> None:
        """`model_source`: weights and tokenizer already loaded for `config.model` (its
        hf_overrides applied), so that many engines over one model read the files once."""
        config = config_on_device(config)
        source = model_source or load_model_source(config.model, config.hf_overrides)
        # A pre-quantized checkpoint's quantization, when `config` leaves it unset.
        config = resolve_quantization(config, source.config.checkpoint_quantization)
        self.config = config
        self.sparsity = sparsity
        self.model_config = source.config
        self.tokenizer = source.tokenizer
        self.workers: TensorParallelWorkers | None = None
        if config.tensor_parallel_size > 1:
            check_tp_divisibility(source.config, config.tensor_parallel_size)
            self.workers = TensorParallelWorkers(config, sparsity, source)
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers)
        self._step_log: StepLog | None = None
        try:
            self._start(config, source)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig, source: ModelSource) -> None:
        self.runner = ModelRunner(config, self.sparsity, source, self.workers)
        self.retention = self.runner.retention
        self.plan = self.retention.plan
        blocks = start_kv_cache(self.runner, config, self.model_config.vocab_size)
        # A chunked prompt's last chunk, and what a prefill computes after a prefix cache hit,
        # must hold the observation window, whose queries score the whole prompt.
        min_last_chunk = self.sparsity.window if self.sparsity.compresses else 1
        self.block_manager = BlockManager(
            self.retention,
            blocks,
            config.max_num_seqs,
            config.max_model_len,
            config.enable_prefix_caching,
            min_last_chunk,
        )
        self.scheduler = Scheduler(config, self.block_manager, min_last_chunk)
        self.checker = RequestChecker(
            self.tokenizer,
            self.model_config.vocab_size,
            config.max_model_len,
            self.retention,
            blocks,
            config.longest_whole_prefill,
        )
        self.output_processor = OutputProcessor(
            self.tokenizer,
            self.scheduler,
            self.plan,
            self.model_config.num_hidden_layers,
            config.max_model_len,
        )
        self.step_records: list[StepRecord] | None = None  # set to [] to record every step
        if config.step_log:
            pool = {"policy": self.sparsity.policy, "budget": self.sparsity.budget}
            self._step_log = StepLog(config.step_log, pool)
        # Tensor-parallel workers get each step's inputs from the host: no step launched ahead.
        enabled = config.async_scheduling
        if enabled is None:
            enabled = self.runner.device.type == "cuda"
        self.async_scheduling = enabled and self.workers is None
        self._ahead: _Flight | None = None  # a step launched before the last one's tokens
        self._last_step_end = 0.0
        self._started = False  # steps before it are the start-up's own
        if config.enable_prefix_caching and self.runner.device.type == "cuda":
            self._warm_up_prefix_hits()
        self.gpu_memory = PeakGpuMemoryMeter(self.runner.device)
        logger.info(
            "engine ready: model %s on %s (%s), %d KV blocks of %d tokens in %d layers, "
            "KV groups %s",
            source.config.name,
            self.runner.device,
            self.runner.dtype,
            blocks,
            self.retention.block_size,
            self.retention.layers_per_block,
            [f"{g.name}:{len(g.layers)}" for g in self.plan.groups],
        )
        self._started = True

    def _warm_up_prefix_hits(self) -> None:
        """A prompt twice, the second time from its cached blocks: the kernels of a prefill
        that starts after cached tokens are compiled now, not at a server's first cache hit
        (about a second then, with the device idle). The cache is emptied afterwards."""
        length = min(self.config.max_model_len - 1, 2048)
        prompt = [1 + i % (self.model_config.vocab_size - 1) for i in range(length)]
        for i in range(2):
            try:
                self.add_request(f"kvsparse-warm-up-{i}", prompt, SamplingParams(max_tokens=1))
            except ValueError as exc:  # a cache too small for it: the first hit compiles them
                logger.info("prefix cache warm-up skipped: %s", exc)
                break
            while self.has_unfinished:
                self.step()
        self.block_manager.clear_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, give the GPU memory back (weights, graphs,
        KV cache) and close the step log; the engine cannot step afterwards."""
        self._finalizer()
        if hasattr(self, "runner"):
            self.runner.close()
        if self._step_log is not None:
            self._step_log.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- requests -----------------------------------------------------------------------------

    def make_sequence(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Sequence:
        """Validate and tokenise a request; raises ValueError naming the problem."""
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.checker.make_sequence(request_id, prompt, params)

    @property
    def sequences(self) -> dict[str, Sequence]:
        """The requests added and not finished yet, by request id."""
        return self.output_processor.sequences

    def _check_running(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("the engine was shut down; start a new one")

    def add_sequence(self, seq: Sequence) -> None:
        self._check_running()
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self.add_sequence(self.make_sequence(request_id, prompt, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks at once; None if it is unknown or already done."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self.output_processor.release(seq)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- stepping -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step (prefill of admitted prompts or of their next chunks, and a token for
        every running sequence done prefilling); returns the outputs of every sequence in it that
        produced a token (not those fed a forced prompt token or a chunk before the last).

        With async scheduling, this step may already have been launched by the previous call,
        and this call may launch the next one before it reads this one's tokens.
        """
        self._check_running()
        flight, self._ahead = self._ahead, None
        if flight is not None and all(seq.is_finished for seq in flight.step.seqs):
            flight = None  # every row was aborted or finished by the step before
        if flight is None:
            step = self.scheduler.schedule()
            if not step:
                return []
            flight = self._launch(step)
        self.scheduler.step_done(flight.step)
        if self.async_scheduling:
            ahead = self.scheduler.schedule_ahead(flight.step, flight.wanted)
            if ahead is not None:
                self._ahead = self._launch(ahead)
        tokens = flight.tokens.tolist()  # waits for the device
        logprobs = flight.tokens.logprobs()
        now = time.monotonic()
        if flight.record is not None:
            # Overlapped steps share wall time: each counts from when the one before it ended.
            record = flight.record
            record.seconds = now - max(flight.start, self._last_step_end)
            record.launch_seconds = flight.launched - flight.start
            record.launched_ahead = flight.start < self._last_step_end
            if self.step_records is not None:
                self.step_records.append(record)
            if self._step_log is not None:
                self._step_log.write(record)
        self._last_step_end = now
        outputs = self.output_processor.process(flight.step, tokens, logprobs, flight.wanted, now)
        for seq, sampled in zip(flight.step.seqs, flight.wanted, strict=True):
            seq.suspect &= not sampled  # a step of its own sampled it: not the cause
        return outputs

    def recover_from_failed_step(self, message: str) -> list[tuple[str, str]]:
        """After `step()` raised: fail the request that caused it, and only that one. Every
        running sequence is preempted and recomputed later; the ones that could have caused the
        failure become suspects, which the scheduler runs one at a time until each has a step
        of its own succeed. A failure with a single candidate fails it, as does a sequence's
        `MAX_FAILED_STEPS`-th failed step (nothing fails forever). Returns the failed requests'
        ids, each with `message`."""
        self._ahead = None  # launched on the state the failure left: recomputed instead
        candidates = self.scheduler.preempt_after_failure()
        failed = [
            s for s in candidates if len(candidates) == 1 or s.num_failed_steps >= MAX_FAILED_STEPS
        ]
        for seq in failed:
            self.abort(seq.request_id)
        return [(seq.request_id, message) for seq in failed]

    def _launch(self, step: ScheduledStep) -> _Flight:
        wanted = [seq.samples_next_token for seq in step.seqs]
        record = None
        if self.step_records is not None or self._step_log is not None:
            record = self._step_record(step)
        seen = kernel_first_launch_count()
        start = time.monotonic()
        logits = self.runner.launch(step, self.block_manager)
        launched = time.monotonic()
        if kernel_first_launch_count() > seen:
            self._report_first_launches(kernel_first_launches(seen), record)
        tokens = self.runner.sample_tokens(step, logits, wanted)
        return _Flight(step, wanted, tokens, start, launched, record)

    def _report_first_launches(
        self, launches: list[FirstLaunch], record: StepRecord | None
    ) -> None:
        """Kernel variants this step had Triton compile or load: in its record, and once the
        engine has started, in a warning, since the device waited for them (what the start-up
        runs is meant to launch every variant serving needs)."""
        seconds = sum(launch.seconds for launch in launches)
        if record is not None:
            record.kernel_first_launch_seconds = seconds
        if self._started:
            logger.warning(
                "a step waited %.2f s for Triton to compile or load %d kernel variant(s) that "
                "start-up did not launch: %s",
                seconds,
                len(launches),
                "; ".join(map(str, launches)),
            )

    def _step_record(self, step: ScheduledStep) -> StepRecord:
        """What the step runs, taken when it is launched (the next step launched ahead changes
        the sequences' counts before this one's tokens are read); its times come later."""
        layers = [len(g.layers) for g in self.plan.groups]
        return StepRecord(
            num_prefill_seqs=len(step.prefills),
            num_prefill_tokens=sum(s.num_scheduled_tokens for s in step.prefills),
            num_decode_seqs=len(step.decodes),
            kv_token_layers=sum(
                n * kv for seq in step.decodes for n, kv in zip(layers, seq.kv_lens, strict=True)
            ),
            seconds=0.0,
            launch_seconds=0.0,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            kv_blocks=self.block_manager.usage(),
            gpu_memory_peak_bytes=self.gpu_memory.read(),
            prefix_cache_queries=self.block_manager.prefix_cache_queries,
            prefix_cache_hits=self.block_manager.prefix_cache_hits,
        )

    def check_invariants(self) -> None:
        """No block leaked or owned twice in any pool (used by tests)."""
        live = self.scheduler.running
        self.block_manager.check_invariants(live)


def _stop_workers(workers: TensorParallelWorkers | None) -> None:
    if workers is not None:
        workers.shutdown()
