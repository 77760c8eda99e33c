"""A request as the engine core sees it, and its lifecycle.

    WAITING --schedule--> RUNNING --update--> FINISHED_{STOPPED,LENGTH}
       ^                   |  ^
       +---- PREEMPTED <---+  |  (blocks ran out: blocks freed, recomputed later)
             SWAPPED <-----+  |  (blocks ran out, room in the swap pool: KV copied to
                +--schedule---+   host blocks, device blocks freed; later copied back)
    any non-terminal state --abort--> FINISHED_ABORTED

    Decode worker: reserve --> WAITING_FOR_REMOTE_KV --commit--> RUNNING
    (blocks are reserved for a prompt another worker computes and sends).

The scheduler owns `Request` objects; everything that leaves the engine core is a
frozen copy (`engine.outputs`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"


TERMINAL_STATUSES = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(eq=False)
class Request:
    """Mutable per-request state inside the engine core (owned by the scheduler)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    """The model's end tokens (eos, end-of-turn); stop the request unless ignore_eos."""
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose K/V are in this request's blocks."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at first admission."""
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if any."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the request's first full blocks, filled in by the KV manager as it
    needs them; valid forever, because tokens are only ever appended."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end generation (used by min_tokens masking and stop checks)."""
        stops = frozenset(self.sampling_params.stop_token_ids)
        return stops if self.sampling_params.ignore_eos else stops | self.eos_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None
