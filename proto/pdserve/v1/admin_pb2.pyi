from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetRolesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerEntry(_message.Message):
    __slots__ = ("worker_id", "address", "state", "incarnation", "heartbeat_age_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    state: str
    incarnation: str
    heartbeat_age_s: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., incarnation: _Optional[str] = ..., heartbeat_age_s: _Optional[float] = ...) -> None: ...

class RoleStatus(_message.Message):
    __slots__ = ("role", "desired", "ready", "draining", "workers", "restarts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    desired: int
    ready: int
    draining: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerEntry]
    restarts: int
    def __init__(self, role: _Optional[str] = ..., desired: _Optional[int] = ..., ready: _Optional[int] = ..., draining: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerEntry, _Mapping]]] = ..., restarts: _Optional[int] = ...) -> None: ...

class GetRolesResponse(_message.Message):
    __slots__ = ("roles", "scaler")
    ROLES_FIELD_NUMBER: _ClassVar[int]
    SCALER_FIELD_NUMBER: _ClassVar[int]
    roles: _containers.RepeatedCompositeFieldContainer[RoleStatus]
    scaler: str
    def __init__(self, roles: _Optional[_Iterable[_Union[RoleStatus, _Mapping]]] = ..., scaler: _Optional[str] = ...) -> None: ...

class ScaleRoleRequest(_message.Message):
    __slots__ = ("role", "replicas")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    role: str
    replicas: int
    def __init__(self, role: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("started", "in_flight")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    started: bool
    in_flight: int
    def __init__(self, started: _Optional[bool] = ..., in_flight: _Optional[int] = ...) -> None: ...
