"""RouterService: the OpenAI API's behaviour, independent of HTTP and of how tokens are made.

Per request: check the model name and the limits (cheap counts, before any work), validate,
render the chat template and tokenize (a short prompt on the event loop, in one call with the
others that arrive in the same loop pass: prompt_encoder.py; a large one in a worker thread, so
it cannot stall the loop), check the context length, fan prompts x n out to the backend as
single-sequence requests, detokenize and apply stop strings per choice, count usage and
metrics. Every path out
(done, stop string, error, client gone) closes the run, which aborts whatever the backend is
still generating.

Backend requests are named by the service (a fresh id per client request), never by the
client's own request id, which is only echoed and logged: two requests reusing one id must not
collide in the workers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from proto.log_context import set_request_id
from router.serving.backend import GenerationBackend
from router.errors import RouterError, internal_error
from router.serving.metrics import RouterMetrics
from router.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeCompletionRequest,
    TokenizeRequest,
)
from router.serving.results import (
    ChoiceUpdate,
    CompletionResult,
    DetokenizeResult,
    ModelCard,
    ResponseHead,
    StreamEvent,
    StreamFailure,
    TokenizeResult,
    UsageReport,
)
from router.serving.run import GenerationPlan, GenerationRun, drain
from router.serving.timeline_recorder import TimelineRecorder
from router.serving.prompt_encoder import PromptEncoder
from router.serving.types import random_id
from router.ops.timeline import TimelineStore
from router.api.validation import (
    Prompt,
    RequestLimits,
    chat_logprobs,
    chat_max_tokens,
    chat_prompt,
    chat_text,
    check_chat_options,
    check_context_length,
    check_limits,
    check_model,
    check_token_ids,
    checked_prompt,
    completion_logprobs,
    completion_prompts,
    num_completion_prompts,
    refuse_unsupported,
    sampling_params,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ResponseStream:
    """A streaming response whose first output has arrived, so it will answer 200.

    Iterate it once; always `aclose()` it (closing early aborts the unfinished backend
    requests). Errors after the start arrive as a StreamFailure event, never raised.
    """

    def __init__(
        self,
        head: ResponseHead,
        prompt_token_ids: tuple[tuple[int, ...], ...],
        n: int,
        num_choices: int,
        events: AsyncGenerator[StreamEvent, None],
        close_run: Callable[[], Awaitable[None]],
    ) -> None:
        self.head = head
        self.prompt_token_ids = prompt_token_ids
        self.n = n
        self.num_choices = num_choices
        self._events = events
        self._close_run = close_run

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._events

    async def aclose(self) -> None:
        await self._events.aclose()
        # The events' own cleanup never runs if they were never iterated; close the run here too.
        await self._close_run()


class RouterService:
    """Serves one model through one GenerationBackend. Safe to share between requests."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        backend: GenerationBackend,
        model_name: str,
        max_model_len: int,
        *,
        model_root: str | None = None,
        metrics: RouterMetrics | None = None,
        enable_prompt_tokens_details: bool = False,
        limits: RequestLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        new_request_id: Callable[[], str] = random_id,
        timelines: TimelineStore | None = None,
    ) -> None:
        """`clock` times latencies (seconds, monotonic); `wall_clock` stamps `created`;
        `new_request_id` names each request towards the backend (unique: the client's own id is
        only echoed, so two requests that reuse one cannot abort each other); `timelines`
        keeps each generation request's timeline by the client's request id (None: none kept)."""
        self.timelines = timelines
        self._tokenizer = tokenizer
        self._backend = backend
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._model_root = model_root or model_name
        self.metrics = metrics or RouterMetrics(model_name, max_model_len)
        self._prompt_tokens_details = enable_prompt_tokens_details
        self._clock = clock
        self._wall_clock = wall_clock
        self._created = int(wall_clock())
        self._limits = limits or RequestLimits()
        self._new_request_id = new_request_id
        # Chat templates and tokenizing a large prompt take CPU time; doing them here keeps the
        # event loop (every other request's stream) moving. Two threads: the tokenizer and the
        # sandboxed template are read-only after loading, so they are safe to share.
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="router-tokenize")
        self._encoder = PromptEncoder(tokenizer)
        """Short prompts, on the loop: those arriving together are tokenized in one call."""

    def model_card(self) -> ModelCard:
        return ModelCard(self.model_name, self._created, self._model_root, self.max_model_len)

    # The four generation methods below take `cached_tokens`: count the prompt tokens served
    # from a prefix cache in the usage even when --enable-prompt-tokens-details is off. The
    # gRPC Usage message always has the field; over HTTP vLLM shows it only with that flag.

    async def complete(
        self, req: CompletionRequest, request_id: str, *, cached_tokens: bool = False
    ) -> CompletionResult:
        """A whole completion. Raises RouterError (InvalidRequest, ModelNotFound, backend's)."""
        return await drain(await self._completion_run(req, request_id, cached_tokens))

    async def stream_complete(
        self, req: CompletionRequest, request_id: str, *, cached_tokens: bool = False
    ) -> ResponseStream:
        """A started completion stream; raises RouterError if it fails before its first output."""
        return await self._start_stream(await self._completion_run(req, request_id, cached_tokens), req)

    async def chat(
        self, req: ChatCompletionRequest, request_id: str, *, cached_tokens: bool = False
    ) -> CompletionResult:
        """A whole chat completion. Raises RouterError."""
        return await drain(await self._chat_run(req, request_id, cached_tokens))

    async def stream_chat(
        self, req: ChatCompletionRequest, request_id: str, *, cached_tokens: bool = False
    ) -> ResponseStream:
        """A started chat stream; raises RouterError if it fails before its first output."""
        return await self._start_stream(await self._chat_run(req, request_id, cached_tokens), req)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResult:
        """Token ids of a prompt or of a templated conversation. Raises RouterError."""
        check_model(req.model, self.model_name)
        return await self._off_loop(self._tokenize, req)

    def _tokenize(self, req: TokenizeRequest) -> TokenizeResult:
        if isinstance(req, TokenizeCompletionRequest):
            ids = tuple(self._tokenizer.encode(req.prompt, req.add_special_tokens))
        else:
            ids = chat_prompt(req, self._tokenizer).token_ids
        strs = tuple(self._tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return TokenizeResult(tokens=ids, max_model_len=self.max_model_len, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResult:
        """Text of token ids (special tokens kept, as vLLM does). Raises RouterError."""
        check_model(req.model, self.model_name)
        return await self._off_loop(self._detokenize, req)

    def _detokenize(self, req: DetokenizeRequest) -> DetokenizeResult:
        ids = tuple(req.tokens)
        if ids:
            check_token_ids(ids, self._tokenizer)
        return DetokenizeResult(self._tokenizer.decode(ids, skip_special_tokens=False))

    async def _off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the CPU threads (short prompts stay on the loop: the hop to a thread and
        back costs more than tokenizing them)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._cpu, functools.partial(fn, *args))

    async def _completion_run(
        self, req: CompletionRequest, request_id: str, cached_tokens: bool
    ) -> GenerationRun:
        recorder = self._recorder(request_id)
        try:
            check_model(req.model, self.model_name)
            refuse_unsupported(req)
            check_limits(req, num_completion_prompts(req), self._limits)
            if small_prompt(req.prompt):
                encoded = ({req.prompt: await self._encoder.encode(req.prompt, req.add_special_tokens)}
                           if isinstance(req.prompt, str) else None)
                plan = self._completion_plan(req, request_id, cached_tokens, encoded)
            else:
                plan = await self._off_loop(self._completion_plan, req, request_id, cached_tokens)
        except RouterError as exc:
            _refused(recorder, exc)
            raise
        return self._run(request_id, plan, recorder)

    def _completion_plan(
        self, req: CompletionRequest, request_id: str, cached_tokens: bool,
        encoded: dict[str, list[int]] | None = None,
    ) -> GenerationPlan:
        logprobs = completion_logprobs(req)
        prompts = completion_prompts(req, self._tokenizer, encoded)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        for prompt in prompts:
            check_context_length(len(prompt.token_ids), max_tokens, self.max_model_len)
        params = sampling_params(req, max_tokens, logprobs)
        return self._plan(
            f"cmpl-{request_id}", req, prompts, (params,) * len(prompts), req.echo, cached_tokens
        )

    async def _chat_run(
        self, req: ChatCompletionRequest, request_id: str, cached_tokens: bool
    ) -> GenerationRun:
        recorder = self._recorder(request_id)
        try:
            check_model(req.model, self.model_name)
            refuse_unsupported(req)
            check_chat_options(req)
            check_limits(req, 1, self._limits)
            if small_chat(req.messages):
                chat_logprobs(req)  # its refusals before the template's, as in _chat_plan
                text = chat_text(req, self._tokenizer)
                ids = await self._encoder.encode(text, req.add_special_tokens)
                plan = self._chat_plan(req, request_id, cached_tokens, checked_prompt(ids, text, self._tokenizer))
            else:
                plan = await self._off_loop(self._chat_plan, req, request_id, cached_tokens)
        except RouterError as exc:
            _refused(recorder, exc)
            raise
        return self._run(request_id, plan, recorder)

    def _recorder(self, request_id: str) -> TimelineRecorder | None:
        """Started at arrival: the timeline's 0 is when the service first sees the request."""
        if self.timelines is None:
            return None
        return TimelineRecorder(self.timelines, request_id, self.model_name, self._clock, self._wall_clock)

    def _chat_plan(
        self, req: ChatCompletionRequest, request_id: str, cached_tokens: bool, prompt: Prompt | None = None
    ) -> GenerationPlan:
        """`prompt`: the conversation already rendered and tokenized (None: done here)."""
        logprobs = chat_logprobs(req)
        prompt = prompt or chat_prompt(req, self._tokenizer)
        max_tokens = chat_max_tokens(req)
        check_context_length(len(prompt.token_ids), max_tokens, self.max_model_len)
        if max_tokens is None:  # vLLM: whatever room the context leaves
            max_tokens = self.max_model_len - len(prompt.token_ids)
        params = sampling_params(req, max_tokens, logprobs)
        return self._plan(
            f"chatcmpl-{request_id}", req, (prompt,), (params,), cached_tokens=cached_tokens
        )

    def _plan(
        self,
        response_id: str,
        req: SamplingFields,
        prompts: tuple[Prompt, ...],
        params: tuple[SamplingParams, ...],
        echo: bool | None = False,
        cached_tokens: bool = False,
    ) -> GenerationPlan:
        options = req.stream_options
        include_usage = bool(req.stream and options and options.include_usage)
        return GenerationPlan(
            response_id=response_id,
            created=int(self._wall_clock()),
            model=self.model_name,
            prompts=prompts,
            params=params,
            echo=bool(echo),
            continuous_usage=include_usage and bool(options and options.continuous_usage_stats),
            prompt_tokens_details=self._prompt_tokens_details or cached_tokens,
        )

    def _run(self, client_request_id: str, plan: GenerationPlan,
             recorder: TimelineRecorder | None = None) -> GenerationRun:
        backend_id = self._new_request_id()
        set_request_id(backend_id)  # the id the workers see: JSON log lines of router and workers join on it
        # %r: the client's id is arbitrary text (newlines included); it is a label, never a key.
        logger.info("request %r runs as %s", client_request_id[:128], backend_id)
        return GenerationRun(
            self._backend, self._tokenizer, self.metrics, backend_id, plan, self._clock, recorder
        )

    async def _start_stream(self, run: GenerationRun, req: SamplingFields) -> ResponseStream:
        try:
            first = await run.next_update()
        except BaseException:
            await run.aclose()
            raise
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _events(run, first, include_usage)
        return ResponseStream(
            run.head(), run.prompt_token_ids, run.n, run.num_choices, events, run.aclose
        )


def _refused(recorder: TimelineRecorder | None, error: RouterError) -> None:
    """A request refused before it ran still gets a timeline (one phase: validate)."""
    if recorder is not None:
        recorder.failed(error)
        recorder.finish(finish_reason=None, path=None, prompt_tokens=0, completion_tokens=0, sequences=0)


async def _events(
    run: GenerationRun, first: ChoiceUpdate | None, include_usage: bool
) -> AsyncGenerator[StreamEvent, None]:
    try:
        update = first
        while update is not None:
            if run.finished:
                # Closed before the last update goes out: its blocks are freed and its metrics
                # counted before the client can see the end, and the last tokens, [DONE] and
                # the response's end then leave in one write instead of two (the close is a
                # loop pass of its own).
                await run.aclose()
            yield update
            update = await run.next_update()
        if include_usage:
            yield UsageReport(run.usage())
    except RouterError as exc:
        logger.warning("stream %s failed after it started: %s", run.head().response_id, exc)
        yield StreamFailure(exc)
    except Exception as exc:  # a bug: still end the client's stream with an error event
        logger.exception("stream %s failed after it started", run.head().response_id)
        yield StreamFailure(internal_error(exc))
    finally:
        await run.aclose()


INLINE_PROMPT_CHARS = 2048
"""Prompts of up to this many characters are tokenized (and chat-templated) on the event loop:
~0.1-0.4 ms of work, less than the hop to the tokenizer thread and back under load."""


def small_prompt(prompt: object) -> bool:
    """A completion prompt short enough to tokenize inline (one string, or token ids)."""
    if isinstance(prompt, str):
        return len(prompt) <= INLINE_PROMPT_CHARS
    return isinstance(prompt, list) and len(prompt) <= INLINE_PROMPT_CHARS and all(
        isinstance(p, int) for p in prompt)


def small_chat(messages: list) -> bool:
    """A conversation short enough to template and tokenize inline (plain-text contents)."""
    total = 0
    for message in messages:
        if not isinstance(message.content, (str, type(None))):
            return False
        total += len(message.content or "")
    return total <= INLINE_PROMPT_CHARS
