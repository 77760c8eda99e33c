"""The public gRPC API (pdserve.v1.Generation) over the same RouterService as HTTP.

Thin: each RPC builds the OpenAI-shaped request RouterService takes, calls it, and encodes
the result; errors map to status codes in router.api.grpc_errors (one place). The API key and
undecodable messages are handled before any method by router.api.grpc_guards. The health service
follows the router's readiness (router.cluster.readiness), refreshed by a background task.

`request_id` in a GenerateRequest is the client's label: echoed in every reply, never a key
(the service names backend requests itself, so two calls reusing one id do not collide).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc
import pydantic
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.pdserve.v1 import admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc
from router.errors import InvalidRequest, RouterError
from router.api.grpc_guards import AdminInterceptor, FrontDoorInterceptor, abort
from router.ops.access import AdminAccess
from router.ops.admin_grpc import ADMIN_METHODS, ADMIN_SERVICE_NAME, AdminServicer
from router.ops.roles import RolesApi
from router.api.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    TokenizeCompletionRequest,
)
from router.cluster.readiness import Readiness
from router.serving.results import ChoiceUpdate, StreamFailure, Usage, UsageReport
from router.serving.types import random_id
from router.api.validation import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Generation"
ROUTE_METADATA = "x-pdserve-route"
"""Where the request went and why (RouteInfo.header_value), as in the HTTP header."""


def _sampling_fields(msg: generation_pb2.GenerateRequest) -> dict:
    """Unset optional fields take vLLM's defaults; a 0 that was sent is validated as sent."""
    s = msg.sampling
    fields = dict(
        model=msg.model or None, n=s.n if s.HasField("n") else 1,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k, min_p=s.min_p, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        include_stop_str_in_output=s.include_stop_str_in_output, ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
    )
    if s.HasField("seed"):
        fields["seed"] = s.seed
    if s.HasField("max_tokens"):
        fields["max_tokens"] = s.max_tokens
    return fields


def _logprobs_out(positions) -> list[common_pb2.TokenLogprobs]:
    if not positions:
        return []
    return [
        common_pb2.TokenLogprobs(
            token_id=p.sampled.token_id, logprob=p.sampled.logprob,
            top=[common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in p.top],
        )
        for p in positions
    ]


def _usage_out(usage: Usage) -> generation_pb2.Usage:
    return generation_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                cached_tokens=usage.cached_tokens or 0)


async def _stream_messages(stream, request_id: str):
    """The stream's messages, then a StreamFailure if it failed. A completion's last message
    (the one with finish_reason) waits for the next event, so that the request's final message
    carries both its finish_reason and the usage, as the proto says."""
    path = stream.head.path or ""
    held = None
    async for event in stream:
        if isinstance(event, UsageReport):
            final = held or generation_pb2.GenerateStreamResponse(request_id=request_id, path=path)
            final.usage.CopyFrom(_usage_out(event.usage))
            held = None
            yield final
            continue
        if held is not None:
            yield held
            held = None
        if isinstance(event, StreamFailure):
            yield event
            return
        out = _delta_out(event, request_id, path)
        if event.finish_reason is None:
            yield out
        else:
            held = out
    if held is not None:
        yield held


def _delta_out(event: ChoiceUpdate, request_id: str, path: str) -> generation_pb2.GenerateStreamResponse:
    out = generation_pb2.GenerateStreamResponse(
        request_id=request_id, index=event.index, text=event.text, token_ids=list(event.token_ids),
        logprobs=_logprobs_out(event.logprobs), finish_reason=event.finish_reason or "", path=path)
    _set_stop_reason(out, event.stop_reason)
    return out


def _set_stop_reason(msg, stop_reason) -> None:
    if isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        msg.stop_token_id = stop_reason


def _invalid(exc: ValueError) -> InvalidRequest:
    """A request model's validation error, worded as over HTTP ("field: problem")."""
    if isinstance(exc, pydantic.ValidationError):
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors()]
        return InvalidRequest("; ".join(problems))
    return InvalidRequest(str(exc))


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, service) -> None:
        self.service = service

    def _request_id(self, msg) -> str:
        return msg.request_id or random_id()

    async def _start(self, msg: generation_pb2.GenerateRequest, request_id: str, stream: bool):
        fields = _sampling_fields(msg)
        if stream:
            # The proto promises usage on every stream's final message: ask for it as an OpenAI
            # client would (stream_options.include_usage).
            fields.update(stream=True, stream_options=StreamOptions(include_usage=True))
        which = msg.WhichOneof("prompt")
        s = msg.sampling
        if which == "chat":
            req = ChatCompletionRequest(
                messages=[ChatMessage(role=m.role, content=m.content) for m in msg.chat.messages],
                logprobs=s.HasField("logprobs"), top_logprobs=s.logprobs if s.HasField("logprobs") else 0,
                **fields)
            call = self.service.stream_chat if stream else self.service.chat
            return await call(req, request_id, cached_tokens=True)
        if which == "text":
            prompt = msg.text
        elif which == "token_ids":
            prompt = list(msg.token_ids.ids)
        else:
            raise InvalidRequest("GenerateRequest needs a prompt: text, token_ids or chat", param="prompt")
        req = CompletionRequest(prompt=prompt, logprobs=s.logprobs if s.HasField("logprobs") else None, **fields)
        call = self.service.stream_complete if stream else self.service.complete
        return await call(req, request_id, cached_tokens=True)

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        request_id = self._request_id(request)
        try:
            result = await self._start(request, request_id, stream=False)
        except RouterError as exc:
            await abort(context, exc)
        except ValueError as exc:
            await abort(context, _invalid(exc))
        if result.head.route:
            context.set_trailing_metadata(((ROUTE_METADATA, result.head.route),))
        reply = generation_pb2.GenerateResponse(
            request_id=request_id, path=result.head.path or "", usage=_usage_out(result.usage))
        for choice in result.choices:
            c = reply.completions.add(index=choice.index, text=choice.text, token_ids=list(choice.token_ids),
                                      finish_reason=choice.finish_reason or "",
                                      logprobs=_logprobs_out(choice.logprobs))
            _set_stop_reason(c, choice.stop_reason)
        return reply

    async def GenerateStream(self, request, context: grpc.aio.ServicerContext):
        request_id = self._request_id(request)
        try:
            stream = await self._start(request, request_id, stream=True)
        except RouterError as exc:
            await abort(context, exc)
        except ValueError as exc:
            await abort(context, _invalid(exc))
        if stream.head.route:
            await context.send_initial_metadata(((ROUTE_METADATA, stream.head.route),))
        try:
            async with contextlib.aclosing(_stream_messages(stream, request_id)) as messages:
                async for out in messages:
                    if isinstance(out, StreamFailure):
                        await abort(context, out.error)
                    yield out
        finally:
            await stream.aclose()

    async def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse(
            models=[generation_pb2.ModelCard(id=self.service.model_name, max_model_len=self.service.max_model_len)])

    async def Tokenize(self, request, context):
        try:
            result = await self.service.tokenize(TokenizeCompletionRequest(
                model=request.model or None, prompt=request.text, add_special_tokens=request.add_special_tokens))
        except RouterError as exc:
            await abort(context, exc)
        except ValueError as exc:
            await abort(context, _invalid(exc))
        return generation_pb2.TokenizeResponse(token_ids=list(result.tokens), max_model_len=result.max_model_len)


class GrpcFrontDoor:
    """The router's public gRPC server and the task that keeps its health statuses true."""

    def __init__(self, server: grpc.aio.Server, port: int, follower: asyncio.Task[None] | None) -> None:
        self.server = server
        self.port = port
        self._follower = follower

    async def stop(self, grace: float) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        await self.server.stop(grace=grace)


async def start_grpc_server(
    service,
    host: str,
    port: int,
    *,
    api_key: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    readiness: Callable[[], Awaitable[Readiness]] | None = None,
    readiness_interval_s: float = 1.0,
    roles: RolesApi | None = None,
    admin_access: AdminAccess | None = None,
) -> GrpcFrontDoor:
    """Serve pdserve.v1.Generation, and pdserve.v1.Admin when `roles` is given (+ health,
    reflection). Messages over `max_message_bytes` are refused by grpc itself
    (RESOURCE_EXHAUSTED) before they reach Python."""
    if (roles is None) != (admin_access is None):
        raise ValueError("roles and admin_access go together: the Admin service needs its guard")
    interceptors: list[grpc.aio.ServerInterceptor] = [FrontDoorInterceptor(SERVICE_NAME, api_key)]
    if admin_access is not None:
        interceptors.append(AdminInterceptor(ADMIN_SERVICE_NAME, ADMIN_METHODS, admin_access))
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", max_message_bytes)])
    bound = server.add_insecure_port(f"{host}:{port}")
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(service), server)
    public = [SERVICE_NAME]
    if roles is not None:
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(roles), server)
        public.append(ADMIN_SERVICE_NAME)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*public, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    await server.start()
    if roles is not None:
        # Admin serves whether or not workers do: scaling up from none is what it is for.
        await health_servicer.set(ADMIN_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    follower = None
    if readiness is None:
        await _set_health(health_servicer, True)
    else:
        await _update_health(health_servicer, readiness)
        follower = asyncio.create_task(_follow_readiness(health_servicer, readiness, readiness_interval_s))
    return GrpcFrontDoor(server, bound, follower)


async def _set_health(servicer: health.aio.HealthServicer, ready: bool) -> None:
    """The server ("") and Generation follow readiness: workers to generate with."""
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


async def _update_health(servicer: health.aio.HealthServicer, readiness: Callable[[], Awaitable[Readiness]]) -> None:
    try:
        state = await readiness()
    except Exception:  # a bug in the check must not stop the follower; report not ready
        logger.exception("readiness check failed")
        await _set_health(servicer, False)
        return
    await _set_health(servicer, state.ready)


async def _follow_readiness(
    servicer: health.aio.HealthServicer, readiness: Callable[[], Awaitable[Readiness]], interval_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await _update_health(servicer, readiness)
