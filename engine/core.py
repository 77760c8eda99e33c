"""EngineCore: the model, its KV cache, the scheduler and the runner — tokens in, tokens out.

    step():  plan = scheduler.schedule() -> result = runner.execute(plan)
             -> outputs = scheduler.update(plan, result)

Workers drive an EngineCore directly (the router detokenizes); the offline LLMEngine
adds text, stop strings and n > 1 on top.

Disaggregated modes use the same loop plus two pairs of verbs:
  prefill worker  hold_finished_blocks=True: a finished request keeps its blocks
                  (`held_block_ids`) until the worker has packed them from `kv_caches`
                  (kv_transfer.packing) and `release_blocks` frees them;
  decode worker   `reserve_remote` allocates blocks for a prompt computed elsewhere; the
                  worker unpacks the received KV into them and `commit_remote` starts decoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.capacity import (
    KVCapacity, check_budget_fits_free, kv_budget, plan_capacity, resolve_max_model_len, weights_bytes,
)
from engine.config import EngineConfig
from engine.cpu_kernels import PagedDecodeKernel, load_decode_kernel, unsupported
from engine.cpu_kernels.rms_norm import load_rms_norm_kernel
from engine.device import (
    StepThreads, available_memory_bytes, memory_for_share, resolve_device, resolve_dtype, resolve_kv_dtype,
    set_num_threads,
)
from engine.kv_cache.block_pool import BlockEvents
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.swap_pool import SwapPool, swap_blocks_for
from engine.loader.model_loader import load_model
from engine.loader.quant_choice import bytes_method
from engine.loader.weights_cache import default_cache_dir
from engine.model.llama import RMSNorm
from engine.model.quantized_linear import head_held_as
from engine.model.spec import ModelSpec
from engine.request import Request
from engine.runner import ModelRunner, allocate_kv_caches, allocate_swap_caches
from engine.scheduler import EngineCoreOutput, Reservation, Scheduler, SchedulerStats
from engine.thread_priority import engine_nice_for
from engine.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreStats:
    """A snapshot of what the core holds (for load reports and metrics)."""

    total_blocks: int
    free_blocks: int
    reserved_blocks: int
    cached_blocks: int
    num_running: int
    num_waiting: int
    num_reserved: int
    queued_prefill_tokens: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_swapped: int = 0
    """Requests swapped out now (their KV in host memory)."""
    num_swapped_out: int = 0
    """Preemptions that swapped the request out (the others recomputed), since start."""
    num_swapped_in: int = 0
    """Swapped-out requests resumed by copying their KV back, since start."""
    swap_blocks_total: int = 0
    """Blocks of the host swap pool (from --swap-space)."""
    swap_blocks_used: int = 0
    prompt_tokens: int = 0
    """Prompt tokens computed here since start (for throughput: the stats line, heartbeats)."""
    generation_tokens: int = 0
    """Tokens sampled here since start."""
    prefill_busy_s: float = 0.0
    """Seconds of steps spent computing prompt tokens since start (SchedulerStats.prefill_busy_s)."""
    decode_busy_s: float = 0.0
    """Seconds of steps spent generating since start."""


def charge_busy_time(stats: SchedulerStats, seconds: float, prompt_tokens: int, generated: int) -> None:
    """Add one step's time to the phase counters, split by the tokens it computed (a step that
    only decoded is all decode time; a chunk of prompt with a few decodes is mostly prefill)."""
    total = prompt_tokens + generated
    if total <= 0:
        return  # a step that computed nothing (aborted work): neither phase ran
    stats.prefill_busy_s += seconds * prompt_tokens / total
    stats.decode_busy_s += seconds * generated / total


class EngineCore:
    def __init__(self, config: EngineConfig, hold_finished_blocks: bool = False) -> None:
        self.config = config
        self.num_threads = set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.engine_nice = engine_nice_for(config.engine_nice, self.device)
        """Nice steps the thread that steps this core takes below its process (ServingLoop)."""
        self.dtype = resolve_dtype(config.dtype, self.device)
        cache_dir = Path(config.weights_cache_dir or default_cache_dir())
        loaded = load_model(config.model, self.dtype, self.device, cache_dir, config.quantization,
                            config.cpu_int4_kernel, config.int4_activations)
        if config.cpu_packed_weights and self.device.type == "cpu":
            from engine.model.packed_linear import pack_linears

            logger.info("oneDNN-packed weights for %d linears", pack_linears(loaded.module))
            _dense_head_above_kernel_rows(loaded.module, loaded.spec)
        self._cpu_norm_kernel(loaded.module)
        self.model_path = loaded.path
        self.spec = loaded.spec
        self.load_seconds = loaded.load_seconds
        self.quantization = loaded.quantization
        self.head = head_held_as(loaded.module)
        """How the output projection is held (engine.capacity.HEADS): its bytes count in the weights."""
        self.tokenizer: Tokenizer = load_tokenizer(config.tokenizer or loaded.path)
        self.eos_token_ids = frozenset(self.tokenizer.stop_token_ids) | frozenset(self.spec.eos_token_ids)
        """Tokens that end a request unless ignore_eos (eos and end-of-turn tokens)."""
        self.max_model_len = self._max_model_len()
        kv_name, kv_torch_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.kv_dtype_name = kv_name
        self.capacity: KVCapacity = plan_capacity(
            self.spec,
            kv_dtype=kv_name,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            kv_budget_bytes=self._kv_budget_bytes(),
            num_blocks_override=config.num_gpu_blocks_override,
        )
        logger.info(self.capacity.log_line())
        kv_caches = allocate_kv_caches(
            self.spec, self.capacity.num_blocks, config.block_size, kv_torch_dtype, self.device,
            huge_pages=config.cpu_kv_huge_pages,
        )
        num_swap_blocks = swap_blocks_for(config.swap_space, self.capacity.bytes_per_block)
        if num_swap_blocks:
            logger.info("swap space: %d blocks (%g GiB of host memory)", num_swap_blocks, config.swap_space)
        swap_caches = allocate_swap_caches(
            self.spec, num_swap_blocks, config.block_size, kv_torch_dtype, self.device
        )
        self.runner = ModelRunner(
            loaded.module, self.spec, kv_caches, config.block_size, self.max_model_len, self.device,
            swap_caches,
            StepThreads.resolve(self.num_threads, config.decode_threads) if self.device.type == "cpu" else None,
            self._cpu_decode_kernel(kv_torch_dtype),
        )
        self.kv = KVCacheManager(self.capacity.num_blocks, config.block_size, config.enable_prefix_caching)
        self.stalled = False
        """The last step had work but could schedule none of it (e.g. every free block is
        reserved for KV in flight): the caller should wait for a change, not spin."""
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.step_tokens, self.max_model_len,
            hold_finished_blocks=hold_finished_blocks, swap=SwapPool(num_swap_blocks),
            long_prefill_token_threshold=config.long_prefill_token_threshold or 0,
            max_long_partial_prefills=config.max_long_partial_prefills,
        )
        if config.long_prefill_token_threshold:
            logger.info("long prompts (over %d tokens): chunks of %d tokens, at most %d at once; shorter prompts "
                        "may go ahead of them; steps of at most %d tokens", config.long_prefill_token_threshold,
                        config.long_prefill_token_threshold, config.max_long_partial_prefills, config.step_tokens)

    def _cpu_decode_kernel(self, kv_dtype: torch.dtype) -> PagedDecodeKernel | None:
        """The C decode attention kernel when this engine runs on CPU, wants it and it takes the
        model; the log says which attention decodes and why."""
        if self.device.type != "cpu" or not self.config.cpu_attention_kernel:
            return None
        spec = self.spec
        reason = unsupported(self.dtype, kv_dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        if reason is not None:
            logger.info("CPU decode attention: torch SDPA (the C kernel does not take %s)", reason)
            return None
        started = time.monotonic()
        kernel, reason = load_decode_kernel()
        if kernel is None:  # slower, not wrong: say so louder
            logger.warning("CPU decode attention: torch SDPA, the C kernel is not available: %s", reason)
            return None
        logger.info("CPU decode attention: C kernel %s (ready in %.1f s)", kernel.path, time.monotonic() - started)
        return kernel

    def _cpu_norm_kernel(self, module: torch.nn.Module) -> None:
        """bfloat16 on the CPU with the C kernels on (cpu_attention_kernel): the model's RMSNorms
        run in engine.cpu_kernels.rms_norm, the residual add fused in."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not self.config.cpu_attention_kernel:
            return
        kernel, reason = load_rms_norm_kernel()
        if kernel is None:
            logger.warning("RMSNorm: torch, the C kernel is not available: %s", reason)
            return
        norms = [m for m in module.modules() if isinstance(m, RMSNorm)]
        for norm in norms:
            norm.kernel = kernel
        logger.info("RMSNorm: C kernel %s (%d norms)", kernel.path, len(norms))

    def _max_model_len(self) -> int:
        return resolve_max_model_len(self.spec, self.config.max_model_len)

    def _kv_budget_bytes(self) -> int | None:
        """engine.capacity.kv_budget, the rule `pdserve plan` uses too."""
        counted = bytes_method(self.quantization, self.model_path)
        weights = weights_bytes(self.spec, str(self.dtype).removeprefix("torch."), counted, self.head)
        budget = kv_budget(self.config, self.device.type, weights, lambda: memory_for_share(self.device, weights))
        if self.device.type == "cuda":  # a share of the whole GPU: others may hold part of it
            check_budget_fits_free(budget, available_memory_bytes(self.device), str(self.device))
        return budget.num_bytes

    # ------------------------------------------------------------------ loop
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_ids: Sequence[str]) -> list[Request]:
        return self.scheduler.abort(request_ids)

    def step(self) -> list[EngineCoreOutput]:
        plan = self.scheduler.schedule()
        self.stalled = plan.is_empty and not plan.finished_ids and not plan.has_copies
        if self.stalled:
            return []
        started = time.perf_counter()
        stats = self.scheduler.stats
        before = (stats.prompt_tokens, stats.generation_tokens)
        result = self.runner.execute(plan)
        outputs = self.scheduler.update(plan, result)
        charge_busy_time(stats, time.perf_counter() - started, stats.prompt_tokens - before[0],
                         stats.generation_tokens - before[1])
        return outputs

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------ prefill worker side
    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Per-layer KV tensors [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.runner.kv_caches

    def held_block_ids(self, request_id: str) -> tuple[int, ...]:
        """Blocks a finished request still holds (prefill side, until release_blocks)."""
        return self.scheduler.held_block_ids(request_id)

    def release_blocks(self, request_id: str) -> None:
        self.scheduler.release_held(request_id)

    # ------------------------------------------------------- decode worker side
    def reserve_remote(self, request: Request) -> Reservation | None:
        return self.scheduler.reserve(request)

    def commit_remote(self, request_id: str, first_token_id: int) -> EngineCoreOutput | None:
        return self.scheduler.commit(request_id, first_token_id)

    # ------------------------------------------------------- prefix-cache events
    def take_block_events(self) -> BlockEvents:
        """Block hashes stored into / evicted from the prefix cache since the last call
        (loop thread only; the caller publishes them for the cluster's prefix index)."""
        return self.kv.take_events()

    def cached_block_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash findable in the prefix cache now (a full snapshot for the index)."""
        return tuple(self.kv.pool.cached_hashes())

    # ------------------------------------------------------------------ state
    QUEUE_HIT_LOOKUPS = 16
    """Waiting requests whose prefix-cache hit is looked up for the load report (each lookup
    hashes the prompt); the rest count their whole prompt."""

    def _queued_prefill_tokens(self) -> int:
        """Prompt tokens the waiting requests still need computed, less what the prefix cache
        already holds for the first few (routers weigh a worker's queue by this)."""
        total = 0
        for i, request in enumerate(self.scheduler.waiting):
            left = request.num_tokens - request.num_computed_tokens
            if i < self.QUEUE_HIT_LOOKUPS and request.num_computed_tokens == 0:
                left -= self.kv.find_prefix(request).num_tokens
            total += left
        return total

    def stats(self) -> CoreStats:
        s = self.scheduler
        return CoreStats(
            total_blocks=self.kv.num_blocks,
            free_blocks=self.kv.num_free_blocks,
            reserved_blocks=s.num_reserved_blocks,
            cached_blocks=self.kv.pool.num_cached_blocks,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_reserved=len(s.reserved),
            queued_prefill_tokens=self._queued_prefill_tokens(),
            num_preemptions=s.stats.num_preemptions,
            prefix_cache_queries=s.stats.prefix_cache_queries,
            prefix_cache_hits=s.stats.prefix_cache_hits,
            num_swapped=len(s.swapped),
            num_swapped_out=s.stats.num_swapped_out,
            num_swapped_in=s.stats.num_swapped_in,
            swap_blocks_total=s.swap.num_blocks,
            swap_blocks_used=s.swap.num_used_blocks,
            prompt_tokens=s.stats.prompt_tokens,
            generation_tokens=s.stats.generation_tokens,
            prefill_busy_s=s.stats.prefill_busy_s,
            decode_busy_s=s.stats.decode_busy_s,
        )


def _dense_head_above_kernel_rows(module: torch.nn.Module, spec: ModelSpec) -> None:
    """A tied Q8_0 head (engine.model.quantized_linear.KernelQ8Linear) gets the token embedding,
    the same values held dense, for its calls of more rows than the C kernel is quicker at."""
    from engine.model.packed_linear import packing_available
    from engine.model.quantized_linear import KernelQ8Linear

    head = getattr(module, "lm_head", None)
    if isinstance(head, KernelQ8Linear) and spec.tie_word_embeddings and packing_available():
        head.pack_above(module.model.embed_tokens.weight)
