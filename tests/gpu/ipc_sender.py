"""The prefill side of tests/gpu/test_cuda_ipc.py, run in its own process:

    python -m tests.gpu.ipc_sender HOST PORT CHANNEL_ID

Sends PAYLOADS through CudaIpcBackend, waits for every result, prints them as one JSON line
({ticket: state}) and exits 0 once all are DONE.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kv_transfer.base import ChannelAddress, TransferConfig, TransferState
from kv_transfer.cuda_ipc import CudaIpcBackend
from kv_transfer.packing import make_header

# ticket, payload shape [layers, 2, blocks, block_size, kv_heads, head_dim], dtype
PAYLOADS = (
    (1, (2, 2, 3, 16, 2, 64), "bfloat16"),
    (2, (4, 2, 0, 16, 2, 64), "float16"),  # no blocks: one empty piece
    (3, (2, 2, 57, 16, 8, 128), "bfloat16"),  # 14.9 MB: many pieces of a 1 MiB staging buffer
    (4, (1, 2, 5, 16, 4, 64), "float32"),
)


def make_payload(ticket: int, shape: tuple[int, ...], dtype: str, device: str) -> torch.Tensor:
    """The same values in every process (CPU generator seeded by the ticket)."""
    g = torch.Generator().manual_seed(ticket)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype)).to(device)


def main(host: str, port: str, channel_id: str) -> int:
    backend = CudaIpcBackend(TransferConfig(device="cuda:0", timeout_s=30.0))
    sender = backend.connect(ChannelAddress(host, int(port), channel_id))
    for ticket, shape, dtype in PAYLOADS:
        payload = make_payload(ticket, shape, dtype, "cuda:0")
        sender.send(make_header(ticket, 100 + ticket, payload), payload)
    results, deadline = {}, time.monotonic() + 60.0
    while len(results) < len(PAYLOADS) and time.monotonic() < deadline:
        results.update({r.ticket_id: r.state.value for r in sender.poll()})
        time.sleep(0.01)
    sender.close()
    print(json.dumps(results))
    return 0 if list(results.values()) == [TransferState.DONE.value] * len(PAYLOADS) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
