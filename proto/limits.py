"""Sizes of internal gRPC messages (router <-> workers), shared by both ends.

gRPC refuses a received message above 4 MiB by default and says so with RESOURCE_EXHAUSTED,
the same code a decode worker uses for "no KV room now". Every internal server and channel
uses this larger bound so that whatever the router accepts (a prompt of max_model_len token
ids, the largest stop list and body the front door allows) fits the messages it causes, and
the router tells the two refusals apart by the worker's explicit no-room mark, never by code.
"""

from __future__ import annotations

INTERNAL_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest internal message either way; well above any request the front door accepts."""

NO_ROOM_METADATA_KEY = "pdserve-no-room"
"""Trailing metadata a decode worker sets (value "1") on its RESOURCE_EXHAUSTED when, and only
when, it has no KV room now; any other RESOURCE_EXHAUSTED is a real error."""


def grpc_message_options() -> list[tuple[str, int]]:
    """Options for grpc.aio.server(...) and internal channels."""
    return [("grpc.max_send_message_length", INTERNAL_MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", INTERNAL_MAX_MESSAGE_BYTES)]
