from proto.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "ticket_timeout_ms", "local_prefill", "stream_first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TICKET_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    ticket_timeout_ms: int
    local_prefill: bool
    stream_first_token: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., ticket_timeout_ms: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., stream_first_token: _Optional[bool] = ...) -> None: ...

class Ticket(_message.Message):
    __slots__ = ("ticket_id", "decode_worker_id", "decode_address", "num_cached_tokens", "num_blocks", "incarnation", "first_token_on_stream")
    TICKET_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ON_STREAM_FIELD_NUMBER: _ClassVar[int]
    ticket_id: int
    decode_worker_id: str
    decode_address: str
    num_cached_tokens: int
    num_blocks: int
    incarnation: str
    first_token_on_stream: bool
    def __init__(self, ticket_id: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., decode_address: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., incarnation: _Optional[str] = ..., first_token_on_stream: _Optional[bool] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("ticket", "tokens")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ticket: Ticket
    tokens: TokenChunk
    def __init__(self, ticket: _Optional[_Union[Ticket, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_token_id", "sampled_at")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_AT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: str
    stop_token_id: int
    sampled_at: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., sampled_at: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    ticket: Ticket
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., ticket: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("bytes", "seconds", "num_blocks", "backend", "wire_seconds")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WIRE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    num_blocks: int
    backend: str
    wire_seconds: float
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., num_blocks: _Optional[int] = ..., backend: _Optional[str] = ..., wire_seconds: _Optional[float] = ...) -> None: ...

class PrefillTiming(_message.Message):
    __slots__ = ("queue_s", "compute_s", "first_token_at")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_AT_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    compute_s: float
    first_token_at: float
    def __init__(self, queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., first_token_at: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "num_cached_tokens", "transfer", "timing")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    num_cached_tokens: int
    transfer: TransferStats
    timing: PrefillTiming
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., transfer: _Optional[_Union[TransferStats, _Mapping]] = ..., timing: _Optional[_Union[PrefillTiming, _Mapping]] = ...) -> None: ...

class OpenChannelRequest(_message.Message):
    __slots__ = ("prefill_worker_id", "prefill_incarnation", "backend")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    prefill_incarnation: str
    backend: str
    def __init__(self, prefill_worker_id: _Optional[str] = ..., prefill_incarnation: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class OpenChannelResponse(_message.Message):
    __slots__ = ("store_host", "store_port", "channel_id")
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    store_host: str
    store_port: int
    channel_id: str
    def __init__(self, store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., channel_id: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "incarnation", "role", "block_size", "total_blocks", "free_blocks", "reserved_blocks", "cached_blocks", "num_running", "num_waiting", "queued_prefill_tokens", "state", "in_flight")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    role: str
    block_size: int
    total_blocks: int
    free_blocks: int
    reserved_blocks: int
    cached_blocks: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    state: str
    in_flight: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., role: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., state: _Optional[str] = ..., in_flight: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_ms",)
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    def __init__(self, timeout_ms: _Optional[int] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("started", "in_flight")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    started: bool
    in_flight: int
    def __init__(self, started: _Optional[bool] = ..., in_flight: _Optional[int] = ...) -> None: ...
