"""Settings checked before a model loads: what a process (a worker, the router, `generate`,
`chat`, `pdserve up` and each of its children) would refuse after a load of many seconds,
refused at once instead, as one line that names the flag or the setting.

Ports: bound once with SO_REUSEADDR, as uvicorn binds (a socket in TIME_WAIT is free), but
without SO_REUSEPORT, which gRPC servers set: a second server would otherwise share a port
with a running one, silently. Port 0 means any free port and is not checked.

Reads the model's shape only (engine.loader.spec_reader: its header, no weights), with the
functions a worker itself calls (engine.capacity, engine.device), so the checks cannot drift
from what the worker does. A KV budget that is a share of the memory free when the worker
starts is not known here; the worker checks that one itself (engine.capacity.KVCacheTooSmall).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from engine.capacity import (
    KVCapacity, kv_budget, kv_dtype_name, plan_capacity, resolve_max_model_len, weights_bytes,
)
from engine.config import EngineConfig
from pdserve.ports import bind_error


def port_problem(host: str, ports: Iterable[tuple[str, int]]) -> str | None:
    """Why one of `ports` ((flag, port) pairs) cannot be listened on at `host`, or None."""
    seen: dict[int, str] = {}
    for flag, port in ports:
        if not port:
            continue
        if port in seen:
            return f"{seen[port]} and {flag} are both {port}"
        seen[port] = flag
        exc = bind_error(host, port)
        if exc is not None:
            return f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror}); choose another {flag}"
    return None


def redis_auth_problem() -> str | None:
    """Why the Redis credentials in the environment ($PDSERVE_REDIS_PASSWORD_FILE) cannot be
    read, or None."""
    from router.cluster.redis_settings import RedisAuth

    try:
        RedisAuth.from_env()
    except ValueError as exc:
        return str(exc)
    return None


class _BudgetNeedsFreeMemory(Exception):
    """The KV budget is a share of the memory free when a worker starts: not known before."""


def _free_memory_unknown() -> int:
    raise _BudgetNeedsFreeMemory


def check_engine_settings(config: EngineConfig) -> KVCapacity | None:
    """Raise what an engine built from `config` would raise for its settings: OSError for a
    model or tokenizer that is not there, ValueError for a device this machine lacks or a
    --max-model-len past the model's, KVCacheTooSmall (a ValueError) for a fixed KV budget
    (--kv-cache-memory, --num-gpu-blocks-override, the CPU default) that cannot hold one
    max_model_len request. Returns that fixed capacity, or None when the budget depends on
    free memory."""
    from engine.loader.locate import resolve_model_path
    from engine.loader.spec_reader import read_spec

    spec = read_spec(resolve_model_path(config.model))
    if config.tokenizer is not None and not Path(config.tokenizer).exists():
        raise FileNotFoundError(f"no tokenizer at {config.tokenizer}: expected a .gguf file or a model folder")
    device_type, dtype = _device_and_dtype(config)
    max_model_len = resolve_max_model_len(spec, config.max_model_len)
    try:
        budget = kv_budget(config, device_type, weights_bytes(spec, dtype), _free_memory_unknown)
    except _BudgetNeedsFreeMemory:
        return None
    return plan_capacity(
        spec, kv_dtype=kv_dtype_name(config.kv_cache_dtype, dtype), block_size=config.block_size,
        max_model_len=max_model_len, kv_budget_bytes=budget.num_bytes,
        num_blocks_override=config.num_gpu_blocks_override,
    )


def _device_and_dtype(config: EngineConfig) -> tuple[str, str]:
    """(device type, dtype name) as a worker resolves them; ValueError for `--device cuda`
    without a CUDA device (engine.device.resolve_device's own message)."""
    from engine.device import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    return device.type, str(resolve_dtype(config.dtype, device)).removeprefix("torch.")
