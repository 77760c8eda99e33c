"""Continuous-batching scheduler: decides each step which tokens of which requests run.

One step: `plan = schedule()` -> runner executes it -> `update(plan, result)`.
Running requests go first (decodes and unfinished prompt chunks), then waiting ones in
arrival order while the token budget, `max_num_seqs` and free blocks allow. A prompt
longer than the remaining budget is chunked. With `long_prefill_token_threshold` set (vLLM's
flag), a prompt longer than it is "long": each step computes at most that many of its tokens,
and while `max_long_partial_prefills` long prompts are being computed, the next waiting short
prompt is admitted ahead of a long one at the head of the queue, so a burst of long prompts
does not hold every short one behind it (shorts keep their order, longs keep theirs).
When blocks run out, the most recently admitted running request is preempted: its blocks
are freed and it is recomputed later, or, when the swap pool has room for them, its blocks
are first copied out to host memory (`SchedulerOutput.swap_out`) and copied back into new
blocks (`swap_in`) before any waiting request is admitted. The runner executes a plan's
copies before its forward pass, so blocks freed while planning may be reused within the
same plan.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.kv_cache.manager import KVCacheManager, PrefixHit
from engine.kv_cache.swap_pool import SwapPool
from engine.request import Request, RequestStatus
from engine.scheduler_types import (  # re-exported: callers import the seams from here
    EngineCoreOutput,
    Reservation,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)

__all__ = [
    "EngineCoreOutput",
    "Reservation",
    "RunnerOutput",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        hold_finished_blocks: bool = False,
        swap: SwapPool | None = None,
        long_prefill_token_threshold: int = 0,
        max_long_partial_prefills: int = 1,
    ) -> None:
        if kv.num_blocks < kv.num_blocks_for(max_model_len):
            # Otherwise a long request could wait forever or keep preempting itself.
            raise ValueError(
                f"{kv.num_blocks} KV blocks cannot hold one request of max_model_len={max_model_len}"
            )
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._finished_ids: list[str] = []
        self.hold_finished_blocks = hold_finished_blocks
        """Prefill worker: finished requests keep their blocks until release_held()."""
        self.held: set[str] = set()
        self.reserved: dict[str, Request] = {}
        """Decode worker: requests whose prompt KV is being computed elsewhere."""
        self.swap = swap if swap is not None else SwapPool(0)
        """Host blocks for preempted requests' KV; 0 blocks: preemption always recomputes."""
        self.swapped: deque[Request] = deque()
        """Swapped-out requests, the next to resume first; they resume before any waiting
        request is admitted."""
        self.long_prefill_token_threshold = long_prefill_token_threshold
        """Prompts longer than this are long: chunks of at most this many tokens; 0: off."""
        self.max_long_partial_prefills = max_long_partial_prefills
        """Most long prompts computed at once; past it, short waiting prompts go first."""

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it can never run (too long)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and request.num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {request.num_prompt_tokens + max_tokens} tokens "
                f"({request.num_prompt_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        if request.num_prompt_tokens >= self.max_model_len or request.num_prompt_tokens == 0:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; it must have between 1 and "
                f"{self.max_model_len - 1} (max_model_len={self.max_model_len})"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """End requests wherever they are; frees their blocks. Unknown ids are ignored."""
        aborted = []
        for request_id in request_ids:
            self.release_held(request_id)
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def finish(self, request: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Move a request to a terminal state and release everything it holds."""
        assert status in {
            RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
        }, f"finish() needs a terminal status, got {status}"
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.reserved[request.request_id]
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.stop_reason = stop_reason
        if self.hold_finished_blocks and status != RequestStatus.FINISHED_ABORTED:
            self.held.add(request.request_id)  # the worker exports them, then releases
        else:
            self.kv.free(request.request_id)
        self.swap.free(request.request_id)  # only a swapped-out request holds any
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def held_block_ids(self, request_id: str) -> tuple[int, ...]:
        if request_id not in self.held:
            raise KeyError(f"request {request_id!r} holds no finished blocks")
        return self.kv.blocks_of(request_id).block_ids

    def release_held(self, request_id: str) -> None:
        """Free a finished request's held blocks (idempotent)."""
        if request_id in self.held:
            self.held.discard(request_id)
            self.kv.free(request_id)

    # ----------------------------------------------------- remote prefill (decode)
    def reserve(self, request: Request) -> Reservation | None:
        """Reserve blocks for a prompt another worker computes; None when they are not
        free now, the batch is full, or swapped-out requests wait to resume first (nothing
        is taken then)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.swapped or len(self.running) + len(self.reserved) >= self.max_num_seqs:
            return None
        hit = self.kv.find_prefix(request)
        blocks = self.kv.allocate(request, request.num_prompt_tokens - hit.num_tokens, hit)
        if blocks is None:
            return None
        self.stats.prefix_cache_queries += request.num_tokens
        self.stats.prefix_cache_hits += hit.num_tokens
        request.num_cached_tokens = hit.num_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return Reservation(hit.num_tokens, blocks.block_ids[len(hit.blocks):])

    def commit(self, request_id: str, first_token_id: int) -> EngineCoreOutput | None:
        """The reserved blocks now hold the prompt's KV: append the first token (sampled
        by the prefill worker) and start decoding. Returns an output only when that first
        token already ends the request. Raises KeyError for an unknown reservation."""
        request = self.reserved.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.kv.cache_computed(request)
        request.output_token_ids.append(first_token_id)
        self.running.append(request)
        status, stop_reason = self._check_stop(request)
        if status is None:
            return None
        self.finish(request, status, stop_reason)
        return EngineCoreOutput(request_id, (), None, request.finish_reason, request.stop_reason,
                                request.num_cached_tokens)

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(self.kv.blocks_of(r)) for r in self.reserved)

    @property
    def has_unfinished(self) -> bool:
        """Requests to step (reservations waiting for remote KV need no step)."""
        return bool(self.waiting or self.running or self.swapped)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        index = 0
        long_running = 0  # long prompts with tokens still to compute after this step
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, preempted, swap_out):
                break  # the request itself was preempted; everything after it already was
            scheduled.append(self._describe(request, num_new))
            budget -= num_new
            long_running += self._prompt_due(request, num_new)
            index += 1
        long_running += sum(self._prompt_due(r) for r in self.running[index:])  # not reached: no budget

        # Nothing resumes or is admitted in a step that had to preempt: blocks are short.
        # (This also keeps swap-outs and swap-ins out of the same plan.)
        if not preempted:
            budget = self._swap_in(budget, scheduled, swap_in)
        while not preempted and not self.swapped and self.waiting and budget > 0 \
                and len(self.running) < self.max_num_seqs:
            position = self._next_admission(long_running)
            if position is None:
                break  # only long prompts wait, and as many as allowed are being computed
            request = self.waiting[position]
            hit = self.kv.find_prefix(request)
            num_new = self._chunk(request, request.num_tokens - hit.num_tokens, budget)
            if self.kv.allocate(request, num_new, hit) is None:
                break  # FIFO: later requests do not overtake the head of the queue
            del self.waiting[position]
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += hit.num_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit.num_tokens
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._describe(request, num_new))
            budget -= num_new
            long_running += self._prompt_due(request, num_new)

        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted_ids=tuple(preempted),
            finished_ids=finished,
            swap_out=tuple(swap_out),
            swap_in=tuple(swap_in),
        )

    def _is_long(self, request: Request) -> bool:
        return 0 < self.long_prefill_token_threshold < request.num_tokens

    def _prompt_due(self, request: Request, num_new: int = 0) -> bool:
        """A long prompt with tokens still to compute after `num_new` more (a chunk is due)."""
        return self._is_long(request) and request.num_computed_tokens + num_new < request.num_prompt_tokens

    def _chunk(self, request: Request, remaining: int, budget: int) -> int:
        """Tokens of `request` to compute this step: what is left, within the budget and, for a
        long prompt, within long_prefill_token_threshold (a decode's 1 token is within it)."""
        cap = self.long_prefill_token_threshold if self._is_long(request) else budget
        return min(remaining, budget, cap)

    def _next_admission(self, long_running: int) -> int | None:
        """Index in `waiting` of the next request to admit: the head, unless it is long and
        max_long_partial_prefills long prompts are being computed; then the first short one."""
        if not self._is_long(self.waiting[0]) or long_running < self.max_long_partial_prefills:
            return 0
        return next((i for i, r in enumerate(self.waiting) if not self._is_long(r)), None)

    def _swap_in(self, budget: int, scheduled: list[ScheduledRequest], swap_in: list[tuple[int, int]]) -> int:
        """Resume swapped-out requests, head first, while blocks, budget and max_num_seqs
        allow. Computed blocks still resident in the prefix cache are reused as they are;
        the others get new device blocks and are listed to copy back. Returns the budget left."""
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            hit = self._resident_prefix(request)
            # The table is empty and allocate() adds the hit to num_computed_tokens, which
            # already covers it: this grows the table to num_computed_tokens + num_new.
            blocks = self.kv.allocate(request, num_new - hit.num_tokens, hit)
            if blocks is None:
                break  # FIFO: nothing overtakes the head of the swapped queue
            self.swapped.popleft()
            # The host blocks are free in the books now; the runner copies them back before
            # any later plan could swap something else out into them.
            swap_ids = self.swap.free(request.request_id)
            first, end = len(hit.blocks), len(swap_ids)
            swap_in.extend(zip(swap_ids[first:], blocks.block_ids[first:end], strict=True))
            request.status = RequestStatus.RUNNING
            self.stats.num_swapped_in += 1
            self.running.append(request)
            scheduled.append(self._describe(request, num_new))
            budget -= num_new
        return budget

    def _resident_prefix(self, request: Request) -> PrefixHit:
        """The request's computed full blocks that are still in the prefix cache."""
        hit = self.kv.find_prefix(request)
        keep = min(len(hit.blocks), request.num_computed_tokens // self.kv.block_size)
        return PrefixHit(hit.blocks[:keep], keep * self.kv.block_size)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted: list[str], swap_out: list[tuple[int, int]]
    ) -> bool:
        """Allocate for `request`, preempting from the back of `running` until it fits.
        Returns False when `request` itself had to be preempted."""
        while self.kv.allocate(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim, swap_out)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, swap_out: list[tuple[int, int]]) -> None:
        """Swap the request out when the swap pool has room for its blocks, else free them
        for recompute. Either way its device blocks are free afterwards."""
        block_ids = self.kv.blocks_of(request.request_id).block_ids
        assert len(block_ids) == self.kv.num_blocks_for(request.num_computed_tokens), (
            f"{request.request_id}: {len(block_ids)} blocks for {request.num_computed_tokens} computed tokens"
        )
        swap_ids = self.swap.allocate(request.request_id, len(block_ids))
        self.kv.free(request.request_id)
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        if swap_ids is not None:
            swap_out.extend(zip(block_ids, swap_ids, strict=True))
            request.status = RequestStatus.SWAPPED
            self.stats.num_swapped_out += 1
            self.swapped.appendleft(request)
            return
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _describe(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        tokens = request.all_token_ids
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(tokens[start : start + num_new]),
            start_position=start,
            block_ids=self.kv.blocks_of(request.request_id).block_ids,
            sample=start + num_new == len(tokens),
            params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=tuple(request.output_token_ids),
            stop_token_ids=request.stop_token_ids,
        )

    # ------------------------------------------------------------------ update
    def update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step's result: advance computed tokens, append samples, stop requests."""
        outputs = []
        for work in plan.scheduled:
            request = self.requests.get(work.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted after the plan was made
            before = request.num_computed_tokens
            request.num_computed_tokens += len(work.token_ids)
            self.stats.prompt_tokens += max(min(request.num_computed_tokens, request.num_prompt_tokens) - before, 0)
            self.kv.cache_computed(request)
            if not work.sample:
                continue
            self.stats.generation_tokens += 1
            token = result.sampled_token_ids[work.request_id]
            request.output_token_ids.append(token)
            status, stop_reason = self._check_stop(request)
            if status is not None:
                self.finish(request, status, stop_reason)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=(token,),
                    logprobs=result.logprobs.get(work.request_id),
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    sampled_at=result.sampled_at,
                )
            )
        return outputs

    def _check_stop(self, request: Request) -> tuple[RequestStatus | None, int | None]:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if request.num_tokens >= self.max_model_len or (
            params.max_tokens is not None and num_output >= params.max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH, None
        if num_output < params.min_tokens:
            return None, None
        token = request.output_token_ids[-1]
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        return None, None
