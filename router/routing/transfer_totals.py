"""KV transfers and failovers as this router saw them (for /metrics, the dashboard and the
stats line): counters only, updated once per request by the P/D request path."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TransferTotals:
    """KV transfers and failovers as seen by this router (for /metrics)."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    prefill_retries: int = 0
    decode_rejections: int = 0
    by_link: dict[tuple[str, str], "LinkTotals"] = field(default_factory=dict)
    """Per (prefill worker, decode worker): what crossed that data channel."""

    def add(self, prefill_id: str, decode_id: str, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.nbytes += nbytes
        self.seconds += seconds
        link = self.by_link.setdefault((prefill_id, decode_id), LinkTotals())
        link.count += 1
        link.nbytes += nbytes
        link.seconds += seconds


@dataclass
class LinkTotals:
    """KV transfers over one prefill -> decode data channel."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
