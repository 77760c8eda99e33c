"""One client request in flight: its backend requests, their choice trackers, timing, usage.

Choice i belongs to prompt i // n and is backend request f"{request_id}-{i}"; a seeded request
gives choice j of each prompt seed + j, so a prompt in a list samples as it would alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.serving.backend import BackendRequest, GenerationBackend, TokenDelta
from router.serving.choice import ChoiceTracker
from router.serving.fanout import FanOut, run_shielded
from router.serving.metrics import RouterMetrics
from router.serving.results import ChoiceUpdate, CompletionResult, ResponseHead, Usage
from router.serving.timeline_recorder import TimelineRecorder
from router.api.validation import Prompt


@dataclass(frozen=True)
class GenerationPlan:
    """A validated request: what to generate, before anything is sent."""

    response_id: str
    created: int
    model: str
    prompts: tuple[Prompt, ...]
    params: tuple[SamplingParams, ...]
    """Per prompt (chat defaults max_tokens per prompt length); `n` as the client asked."""
    echo: bool = False
    continuous_usage: bool = False
    prompt_tokens_details: bool = False

    @property
    def n(self) -> int:
        return self.params[0].n


def backend_requests(request_id: str, plan: GenerationPlan) -> list[BackendRequest]:
    """One single-sequence backend request per choice, prompts x n."""
    requests = []
    for p, (prompt, params) in enumerate(zip(plan.prompts, plan.params, strict=True)):
        for j in range(params.n):
            seed = None if params.seed is None else params.seed + j
            one = params if params.n == 1 else dataclasses.replace(params, n=1, seed=seed)
            requests.append(BackendRequest(f"{request_id}-{p * plan.n + j}", prompt.token_ids, one))
    return requests


class GenerationRun:
    """Drives one client request's backend requests. Not thread-safe; call aclose() always."""

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Tokenizer,
        metrics: RouterMetrics,
        request_id: str,
        plan: GenerationPlan,
        clock: Callable[[], float],
        recorder: TimelineRecorder | None = None,
    ) -> None:
        """recorder: writes this request's timeline when it ends (None: no timeline)."""
        self._plan = plan
        self._recorder = recorder
        self._metrics = metrics
        self._clock = clock
        requests = backend_requests(request_id, plan)
        self._trackers = [self._tracker(i, r, tokenizer) for i, r in enumerate(requests)]
        self._fanout = FanOut(backend, requests)
        self._started = clock()
        self._last_token_at: list[float | None] = [None] * len(requests)
        self._ended_at: list[float | None] = [None] * len(requests)
        self._path: str | None = None
        self._route: str | None = None
        self._closed = False
        for request in requests:
            metrics.count_prompt(len(request.prompt_token_ids))

    def _tracker(self, i: int, request: BackendRequest, tokenizer: Tokenizer) -> ChoiceTracker:
        prompt = self._plan.prompts[i // self._plan.n]
        echo = (prompt.text or "") if self._plan.echo else ""
        return ChoiceTracker(i, tokenizer, request.prompt_token_ids, request.params, echo)

    @property
    def prompt_token_ids(self) -> tuple[tuple[int, ...], ...]:
        return tuple(p.token_ids for p in self._plan.prompts)

    @property
    def n(self) -> int:
        return self._plan.n

    @property
    def num_choices(self) -> int:
        return len(self._trackers)

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason (the last update has been returned)."""
        return all(t.finished for t in self._trackers)

    def head(self) -> ResponseHead:
        plan = self._plan
        return ResponseHead(plan.response_id, plan.created, plan.model, self._path, self._route)

    async def next_update(self) -> ChoiceUpdate | None:
        """The next choice update, or None when every choice has finished.

        Raises the backend's RouterError. A stop string stops (and aborts) its backend request.
        """
        item = await self._next()
        if item is None:
            return None
        i, delta = item
        if self._recorder is not None:
            self._recorder.on_delta(i, delta)
        self._path = self._path or delta.path
        if self._route is None and delta.route is not None:
            self._route = delta.route.header_value()
            self._metrics.observe_queue_time(delta.route.queue_s)
        tracker = self._trackers[i]
        before = tracker.num_tokens
        update = tracker.apply(delta)
        self._metrics.count_generated(tracker.num_tokens - before)  # a stop string may trim the delta
        self._observe_tokens(i, len(delta.token_ids))
        if tracker.stopped_by_string:
            await self._fanout.stop(i)
        if tracker.finished:
            self._ended_at[i] = self._clock()
        if self._plan.continuous_usage:
            usage = Usage(len(self._plan.prompts[i // self._plan.n].token_ids), tracker.num_tokens)
            update = dataclasses.replace(update, usage=usage)
        if delta.sampled_at:  # a stop string may have consumed fewer tokens than the delta had
            update = dataclasses.replace(update, sampled_at=delta.sampled_at[: len(update.token_ids)])
        return update

    async def _next(self) -> tuple[int, TokenDelta] | None:
        if self._recorder is None:
            return await self._fanout.next()
        self._recorder.dispatched()
        try:
            return await self._fanout.next()
        except Exception as exc:
            self._recorder.failed(exc)
            raise

    def _observe_tokens(self, i: int, count: int) -> None:
        if count == 0:
            return
        now, last = self._clock(), self._last_token_at[i]
        if last is None:
            self._metrics.observe_first_token(now - self._started)
        else:
            self._metrics.observe_inter_token(now - last)
        self._last_token_at[i] = now

    def usage(self) -> Usage:
        """Prompt tokens counted once per prompt (not per choice), as OpenAI and vLLM do."""
        plan = self._plan
        cached = None
        if plan.prompt_tokens_details:
            firsts = range(0, len(self._trackers), plan.n)  # choice 0 of each prompt
            cached = sum(self._trackers[i].num_cached_tokens for i in firsts)
        return Usage(
            prompt_tokens=sum(len(p.token_ids) for p in plan.prompts),
            completion_tokens=sum(t.num_tokens for t in self._trackers),
            cached_tokens=cached,
        )

    def result(self) -> CompletionResult:
        return CompletionResult(
            head=self.head(),
            choices=tuple(t.result() for t in self._trackers),
            usage=self.usage(),
            prompt_token_ids=self.prompt_token_ids,
            n=self._plan.n,
        )

    async def aclose(self) -> None:
        """Abort whatever is unfinished (even if the caller is being cancelled), then record
        metrics. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await run_shielded(self._close())

    async def _close(self) -> None:
        await self._fanout.aclose()
        now = self._clock()
        for i, tracker in enumerate(self._trackers):
            self._metrics.observe_finished(
                finished_reason=tracker.finish_reason or "abort",
                prompt_tokens=len(self._plan.prompts[i // self._plan.n].token_ids),
                generation_tokens=tracker.num_tokens,
                e2e_seconds=(self._ended_at[i] or now) - self._started,
                path=self._path,
            )
        if self._recorder is not None:
            usage = self.usage()
            self._recorder.finish(
                finish_reason=self._trackers[0].finish_reason, path=self._path,
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                sequences=len(self._trackers))


async def drain(run: GenerationRun) -> CompletionResult:
    """Run to the end and return the whole result; closes the run (aborting on error)."""
    try:
        while await run.next_update() is not None:
            pass
    finally:
        await run.aclose()
    return run.result()
