"""LLMEngine: one loop over schedule -> execute -> update, plus text in and text out.

    add_request -> Scheduler.waiting -> step(): plan = scheduler.schedule()
                                                result = runner.execute(plan)
                                                core = scheduler.update(plan, result)
                                                outputs = output_processor.process(core)

n > 1: completion 0 runs first; the others wait until its prompt is computed and then
find the prompt's full blocks in the prefix cache, so the n completions share them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.capacity import KVCapacity, plan_capacity, weights_bytes
from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from engine.device import (
    available_memory_bytes, resolve_device, resolve_dtype, resolve_kv_dtype, set_num_threads,
)
from engine.kv_cache.manager import KVCacheManager
from engine.loader.model_loader import load_model
from engine.loader.weights_cache import default_cache_dir
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner, allocate_kv_caches
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_threads = set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        cache_dir = config.weights_cache_dir or default_cache_dir()
        from pathlib import Path

        loaded = load_model(config.model, self.dtype, self.device, Path(cache_dir))
        self.model_path = loaded.path
        self.spec = loaded.spec
        self.load_seconds = loaded.load_seconds
        self.tokenizer: Tokenizer = load_tokenizer(config.tokenizer or loaded.path)
        self.max_model_len = self._max_model_len()
        kv_name, kv_torch_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
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
            self.spec, self.capacity.num_blocks, config.block_size, kv_torch_dtype, self.device
        )
        self.runner = ModelRunner(
            loaded.module, self.spec, kv_caches, config.block_size, self.max_model_len, self.device
        )
        self.kv = KVCacheManager(self.capacity.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.stop_token_ids) | frozenset(self.spec.eos_token_ids)
        self._deferred: dict[str, list[Request]] = {}

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.model_path.stem

    def _max_model_len(self) -> int:
        limit = self.spec.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(
                f"max_model_len={wanted} is longer than the model's context length ({limit})"
            )
        return wanted

    def _kv_budget_bytes(self) -> int | None:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return None
        if cfg.kv_cache_memory is not None:
            return cfg.kv_cache_memory
        if self.device.type == "cpu" and cfg.gpu_memory_utilization is None:
            return DEFAULT_CPU_KV_CACHE_MEMORY
        share = cfg.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        # The weights are already resident, so budget = share of what was there before them.
        weights = weights_bytes(self.spec, str(self.dtype).removeprefix("torch."))
        total = available_memory_bytes(self.device) + weights
        return max(int(total * share) - weights, 0)

    # ------------------------------------------------------------------ intake
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
    ) -> None:
        """Queue a prompt (text or token ids). Raises ValueError if it can never run."""
        if isinstance(prompt, str):
            text, token_ids = prompt, tuple(self.tokenizer.encode(prompt))
        else:
            text, token_ids = None, tuple(int(t) for t in prompt)
        vocab = self.spec.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (0..{vocab - 1})")
        children = [
            Request(child_id, token_ids, params, self.eos_token_ids)
            for child_id in self.output_processor.add_request(request_id, text, token_ids, params)
        ]
        try:
            self.scheduler.add_request(children[0])
        except ValueError:
            self.output_processor.finish_aborted([c.request_id for c in children])
            raise
        if len(children) > 1:
            self._deferred[children[0].request_id] = children[1:]

    def abort_request(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """End requests (by the ids given to add_request) and free their blocks."""
        child_ids = []
        for request_id in request_ids:
            for child_id in self.output_processor.child_ids(request_id):
                child_ids.append(child_id)
                for deferred in self._deferred.pop(child_id, []):
                    child_ids.append(deferred.request_id)
        self.scheduler.abort(child_ids)
        return self.output_processor.finish_aborted(child_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._deferred)

    # -------------------------------------------------------------------- loop
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        core_outputs = self.scheduler.update(plan, result)
        self._release_deferred()
        outputs, stopped = self.output_processor.process(core_outputs)
        for child_id, stop_string in stopped.items():
            request = self.scheduler.requests.get(child_id)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED, stop_string)
        return outputs

    def _release_deferred(self) -> None:
        """Admit siblings of n > 1 requests once the first one's prompt is computed."""
        for first_id in list(self._deferred):
            first = self.scheduler.requests.get(first_id)
            if first is None or first.num_computed_tokens >= first.num_prompt_tokens:
                for sibling in self._deferred.pop(first_id):
                    self.scheduler.add_request(sibling)

    # ------------------------------------------------------------------- state
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def num_used_blocks(self) -> int:
        return self.kv.num_blocks - self.kv.num_free_blocks
