"""Data plane between prefill and decode workers: the interface (base), a channel pool, and
backends chosen by name from KV_TRANSFER_BACKENDS ("local", "gloo", "nccl").

Importing this package loads no torch; packing and the backends are imported where used.
"""

from kv_transfer.base import (
    KV_TRANSFER_BACKENDS,
    ChannelAddress,
    DTypeCode,
    KVReceiver,
    KVSender,
    KVTransferBackend,
    ReceivedKV,
    TransferConfig,
    TransferHeader,
    TransferResult,
    TransferState,
)
from kv_transfer.pool import ChannelPool

__all__ = [
    "KV_TRANSFER_BACKENDS",
    "ChannelAddress",
    "ChannelPool",
    "DTypeCode",
    "KVReceiver",
    "KVSender",
    "KVTransferBackend",
    "ReceivedKV",
    "TransferConfig",
    "TransferHeader",
    "TransferResult",
    "TransferState",
]
