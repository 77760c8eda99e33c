"""The bad inputs of tests/faults/test_bad_input.py, as data: HTTP requests and gRPC payloads.

`expect` is the exact status (HTTP) or code (gRPC) where the answer is certain; None where
several answers are right (e.g. a role the chat template may or may not accept) and only the
suite's general rules apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from proto.pdserve.v1 import common_pb2, generation_pb2

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
BASE = {"prompt": "Hello", "max_tokens": 2}
MESSAGES = [{"role": "user", "content": "Hi"}]
BASE_CHAT = {"messages": MESSAGES, "max_tokens": 2}
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class HttpCase:
    name: str
    path: str
    body: dict | list | None = None
    """Sent as JSON (lone surrogates escaped); with `streams`, also once with stream=True."""
    content: bytes | None = None
    """Raw bytes instead of `body`."""
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    auth: bool = True
    expect: int | None = 400
    streams: bool = True


def _cmpl(name: str, expect: int | None = 400, **fields) -> HttpCase:
    return HttpCase(name, CMPL, {**BASE, **fields}, expect=expect)


def _chat(name: str, expect: int | None = 400, **fields) -> HttpCase:
    return HttpCase(name, CHAT, {**BASE_CHAT, **fields}, expect=expect)


def _raw(name: str, content: bytes, expect: int | None = 400, **kw) -> HttpCase:
    return HttpCase(name, CMPL, content=content, headers=kw.pop("headers", JSON), expect=expect,
                    streams=False, **kw)


HTTP_CASES: tuple[HttpCase, ...] = (
    # The door: key, route, method.
    HttpCase("no api key", CMPL, BASE, auth=False, expect=401),
    HttpCase("wrong api key", CMPL, BASE, auth=False, headers={"authorization": "Bearer nope"}, expect=401),
    HttpCase("unknown route", "/v2/nothing", method="GET", expect=404, streams=False),
    HttpCase("wrong method", CMPL, method="GET", expect=405, streams=False),
    HttpCase("post to models", "/v1/models", BASE, expect=405, streams=False),
    # Bodies that are not a JSON object.
    _raw("invalid json", b'{"prompt": "a"'),
    _raw("invalid utf-8", b'{"prompt": "\xff\xfe\xfd"}'),
    _raw("deeply nested json", b"[" * 200_000 + b"]" * 200_000),
    _raw("deeply nested object", b'{"prompt": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}"),
    _raw("json array body", b"[1, 2, 3]"),
    _raw("json string body", b'"Hello"'),
    _raw("empty body", b""),
    _raw("wrong content type", b'{"prompt": "Hello"}', headers={"content-type": "text/plain"}),
    _raw("no content type", b'{"prompt": "Hello"}', headers={}),
    _raw("20 MB prompt", b'{"prompt": "' + b"a" * 20_000_000 + b'"}', expect=413),
    _raw("4.8 MB stop list", b'{"prompt": "Hello", "stop": ["' + b'xxxxxxxx", "' * 480_000 + b'x"]}',
         expect=413),
    # Completions fields.
    HttpCase("prompt missing", CMPL, {"max_tokens": 2}),
    _cmpl("prompt empty", prompt=""),
    _cmpl("prompt wrong type", prompt={"a": 1}),
    _cmpl("prompt lone surrogate", prompt="a\ud800b"),
    _cmpl("prompt token id out of vocab", prompt=[10**6]),
    _cmpl("prompt token id negative", prompt=[-1]),
    _cmpl("prompt token id int32 overflow", prompt=[2**31]),
    _cmpl("prompt longer than context", prompt="hello " * 1500),
    _cmpl("unknown model", expect=404, model="gpt-4"),
    _cmpl("n zero", n=0),
    _cmpl("n negative", n=-1),
    _cmpl("n a million", n=1_000_000),
    _cmpl("n wrong type", n="many"),
    _cmpl("prompts x n too many", prompt=["a"] * 20, n=100),
    _cmpl("temperature negative", temperature=-1),
    _cmpl("temperature wrong type", temperature="hot"),
    _cmpl("top_p zero", top_p=0),
    _cmpl("top_p above one", top_p=2),
    _cmpl("top_k int32 overflow", top_k=2**31),
    _cmpl("top_k negative", top_k=-5),
    _cmpl("min_p above one", min_p=1.5),
    _cmpl("presence_penalty huge", presence_penalty=5),
    _cmpl("repetition_penalty zero", repetition_penalty=0),
    _cmpl("max_tokens zero", max_tokens=0),
    _cmpl("max_tokens int32 overflow", max_tokens=2**31),
    _cmpl("max_tokens beyond context", max_tokens=100_000),
    _cmpl("max_tokens huge number", max_tokens=10**30),
    _cmpl("min_tokens above max_tokens", min_tokens=5),
    _cmpl("seed uint64 overflow", seed=2**64),
    _cmpl("stop_token_ids int32 overflow", stop_token_ids=[2**31]),
    _cmpl("stop_token_ids wrong type", stop_token_ids=["x"]),
    _cmpl("stop too many", stop=["x"] * 1000),
    _cmpl("stop too long", stop=["y" * 2000]),
    _cmpl("stop lone surrogate", stop=["\udc00"]),
    _cmpl("stop empty string", stop=[""]),
    _cmpl("logprobs negative", logprobs=-1),
    _cmpl("logprobs above max", logprobs=21),
    _cmpl("logprobs int32 overflow", logprobs=2**31),
    _cmpl("echo with logprobs", echo=True, logprobs=1),
    _cmpl("suffix", suffix="x"),
    _cmpl("logit_bias", logit_bias={"1": 5}),
    _cmpl("beam search", use_beam_search=True),
    _cmpl("prompt_logprobs", prompt_logprobs=1),
    _cmpl("response_format json", response_format={"type": "json_object"}),
    HttpCase("stream_options without stream", CMPL, {**BASE, "stream_options": {"include_usage": True}},
             streams=False),
    # Chat fields.
    HttpCase("messages missing", CHAT, {"max_tokens": 2}),
    _chat("messages not a list", messages="Hi"),
    _chat("messages empty", messages=[]),
    _chat("message without role", messages=[{"content": "Hi"}]),
    _chat("role wrong type", messages=[{"role": 5, "content": "Hi"}]),
    _chat("unknown role", expect=None, messages=[{"role": "wizard", "content": "Hi"}]),
    _chat("content lone surrogate", messages=[{"role": "user", "content": "\ud800"}]),
    _chat("content image part", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    _chat("top_logprobs without logprobs", top_logprobs=2),
    _chat("top_logprobs negative", logprobs=True, top_logprobs=-1),
    _chat("top_logprobs above max", logprobs=True, top_logprobs=21),
    _chat("logprobs wrong type", logprobs={"a": 1}),
    _chat("tool_choice required", tool_choice="required"),
    _chat("request chat template", chat_template="{{ 1 }}"),
    _chat("n a million", n=1_000_000),
    _chat("max_completion_tokens overflow", max_completion_tokens=2**40),
    # Tokenizer routes.
    HttpCase("tokenize lone surrogate", "/tokenize", {"prompt": "\ud800"}, streams=False),
    HttpCase("tokenize nothing", "/tokenize", {}, streams=False),
    HttpCase("detokenize out of vocab", "/detokenize", {"tokens": [10**6]}, streams=False),
    HttpCase("detokenize negative", "/detokenize", {"tokens": [-1]}, streams=False),
)


@dataclass(frozen=True)
class GrpcCase:
    name: str
    method: str
    """Generate (also sent as GenerateStream), Tokenize or ListModels."""
    payload: bytes
    expect: grpc.StatusCode | None = grpc.StatusCode.INVALID_ARGUMENT
    metadata: tuple[tuple[str, str], ...] | None = None
    """None: the right key."""


def _gen(name: str, expect=grpc.StatusCode.INVALID_ARGUMENT, metadata=None, text="Hello", **sampling) -> GrpcCase:
    sampling.setdefault("max_tokens", 2)
    msg = generation_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(**sampling))
    return GrpcCase(name, "Generate", msg.SerializeToString(), expect, metadata)


def _msg(name: str, msg, expect=grpc.StatusCode.INVALID_ARGUMENT) -> GrpcCase:
    return GrpcCase(name, "Generate", msg.SerializeToString(), expect)


def _invalid_utf8_text() -> bytes:
    # "AB" swapped for the UTF-8 spelling of a lone surrogate, which no conforming encoder writes.
    return generation_pb2.GenerateRequest(text="AB").SerializeToString().replace(b"AB", b"\xed\xa0")


_TWO = common_pb2.SamplingParams(max_tokens=2)  # a case that is served must not run long
_CHAT = generation_pb2.ChatMessages
_MSG = generation_pb2.ChatMessage
NO_KEY = ()
WRONG_KEY = (("authorization", "Bearer nope"),)
UNAUTH = grpc.StatusCode.UNAUTHENTICATED

GRPC_CASES: tuple[GrpcCase, ...] = (
    _gen("no api key", UNAUTH, NO_KEY),
    _gen("wrong api key", UNAUTH, WRONG_KEY),
    GrpcCase("tokenize without key", "Tokenize", generation_pb2.TokenizeRequest(text="hi").SerializeToString(),
             UNAUTH, NO_KEY),
    GrpcCase("list models without key", "ListModels", b"", UNAUTH, NO_KEY),
    GrpcCase("garbage bytes", "Generate", b"\xff\xff\xff\xff\x0f garbage"),
    GrpcCase("garbage bytes to tokenize", "Tokenize", b"\x0a\xff\xff\xff"),
    GrpcCase("invalid utf-8 text", "Generate", _invalid_utf8_text()),
    GrpcCase("3 MB message", "Generate", generation_pb2.GenerateRequest(text="a" * 3_000_000).SerializeToString(),
             grpc.StatusCode.RESOURCE_EXHAUSTED),
    _msg("no prompt", generation_pb2.GenerateRequest()),
    _gen("top_p zero", top_p=0.0),
    _gen("n zero", n=0),
    _gen("n a million", n=1_000_000),
    _gen("temperature negative", temperature=-1.0),
    _gen("top_k negative", top_k=-5),
    _gen("repetition_penalty zero", repetition_penalty=0.0),
    _gen("max_tokens beyond context", max_tokens=2**32 - 1),
    _gen("logprobs above max", logprobs=21),
    _gen("stop too many", stop=["x"] * 1000),
    _gen("stop too long", stop=["y" * 2000]),
    _gen("stop empty string", stop=[""]),
    _gen("min_tokens above max_tokens", min_tokens=5),
    _gen("prompt empty", text=""),
    _gen("prompt longer than context", text="hello " * 1500),
    _msg("unknown model", generation_pb2.GenerateRequest(model="gpt-4", text="Hi", sampling=_TWO),
         grpc.StatusCode.NOT_FOUND),
    _msg("token id out of vocab", generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[10**6]))),
    _msg("token id negative", generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[-1]))),
    _msg("chat without messages", generation_pb2.GenerateRequest(chat=_CHAT(), sampling=_TWO), None),
    _msg("chat unknown role", generation_pb2.GenerateRequest(chat=_CHAT(messages=[_MSG(role="wizard", content="Hi")]),
                                                             sampling=_TWO), None),
)
