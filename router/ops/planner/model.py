"""The profile-free planner's model: live measurements in, prefill and decode counts out, with
the arithmetic as text lines an operator can check (pure: no I/O, no clock).

No offline profile: each role's capacity is what its workers measured while they ran (tokens
per second of engine-busy time, so an idle worker does not look slow), and the demand is what
arrived at the router over the window. Each role is sized on its own:

    prefill  prompt tokens arriving (the larger of this router's count and what the prefill
             workers computed, so several routers' traffic is seen) (+ the backlog queued on the prefill workers, spread over
             the window) / (one worker's prefill tok/s x target utilisation); and one more
             than now when TTFT p99 misses its SLO while the prefill workers are busy.
    decode   the largest of: output tokens arriving / (one worker's decode tok/s at its batch
             x target utilisation); the requests in decode batches / the streams one worker
             can hold within the ITL SLO (when ITL p99 misses it while the workers are busy);
             those requests / the concurrency one worker's KV cache holds at the mean request
             length (x target utilisation).

Then each count is held within the role's min / max. Idle (nothing arrived, nothing queued)
gives the minimums. A role whose throughput was never measured keeps its current count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

PLAN_ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleBounds:
    """The counts a recommendation stays within, per role (autoscale's min and max)."""

    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4

    def __post_init__(self) -> None:
        for role in PLAN_ROLES:
            low, high = self.low(role), self.high(role)
            if low < 0 or high < 1 or low > high:
                raise ValueError(f"autoscale {role} bounds must satisfy 0 <= min <= max, max >= 1; "
                                 f"got min {low}, max {high}")

    def low(self, role: str) -> int:
        return getattr(self, f"min_{role}")

    def high(self, role: str) -> int:
        return getattr(self, f"max_{role}")

    def clamp(self, role: str, count: int) -> int:
        return min(max(count, self.low(role)), self.high(role))

    def within(self, max_replicas: int) -> RoleBounds:
        """These bounds held to the roles API's --max-replicas, the most replicas it lets any
        scale ask for (so the autoscaler never plans a count it would be refused). A bound an
        operator set above it contradicts it: ValueError naming both flags (as Kubernetes
        refuses an HPA whose minReplicas exceeds maxReplicas). A bound left at its default is
        lowered to it instead (`--max-replicas 2` alone must not need autoscale flags), never
        below 1 for a max."""
        defaults = RoleBounds()
        lowered: dict[str, int] = {}
        for role in PLAN_ROLES:
            for side in ("min", "max"):
                name = f"{side}_{role}"
                value = getattr(self, name)
                if value <= max_replicas:
                    continue
                if value != getattr(defaults, name):
                    raise ValueError(
                        f"--autoscale-{side}-{role} {value} is above --max-replicas {max_replicas}: the roles "
                        f"API refuses any scale past {max_replicas}, so the autoscaler could never get there; "
                        f"lower --autoscale-{side}-{role} or raise --max-replicas")
                lowered[name] = max(max_replicas, 1 if side == "max" else 0)
        return replace(self, **lowered) if lowered else self


@dataclass(frozen=True)
class PlanSettings:
    """What the planner aims for (router flags --slo-ttft-ms, --slo-itl-ms, --plan-*)."""

    slo_ttft_ms: float | None = None
    """Time-to-first-token p99 target; None: no TTFT rule."""
    slo_itl_ms: float | None = None
    """Inter-token latency p99 target; None: no ITL rule."""
    target_utilization: float = 0.8
    """Busy fraction a worker is sized for (headroom for bursts): capacity x this."""
    bounds: RoleBounds = field(default_factory=RoleBounds)

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target utilization must be in (0, 1]; got {self.target_utilization}")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0; got {value}")


@dataclass(frozen=True)
class PlanInputs:
    """Live measurements over the last window_s seconds (router.ops.planner.collector)."""

    window_s: float
    """Seconds the rates are measured over."""
    current_prefill: int
    current_decode: int
    prompt_tokens_per_s: float = 0.0
    """Prompt tokens of requests arriving at this router (counted as they finish)."""
    output_tokens_per_s: float = 0.0
    """Output tokens of those requests."""
    prefill_computed_tokens_per_s: float = 0.0
    """Prompt tokens the prefill workers computed (cluster-wide: every router's traffic)."""
    decode_generated_tokens_per_s: float = 0.0
    """Tokens the decode workers generated (cluster-wide)."""
    mean_request_tokens: float = 0.0
    """Mean prompt + output tokens per request (0: no request finished in the window)."""
    prefill_tokens_per_busy_s: float | None = None
    """One prefill worker's prompt tokens per engine-busy second (mean of the role); None: never measured."""
    decode_tokens_per_busy_s: float | None = None
    """One decode worker's generated tokens per busy second, at the batch it ran."""
    prefill_utilization: float = 0.0
    """Busy fraction of the prefill workers over the window (0..1)."""
    decode_utilization: float = 0.0
    queued_prefill_tokens: int = 0
    """Prompt tokens waiting on the prefill workers now."""
    decode_running: float = 0.0
    """Requests in decode batches (all decode workers, mean over the window) plus those
    waiting at the router's admission queue for decode room."""
    decode_batch: float = 0.0
    """Mean requests in one decode worker's batch."""
    kv_tokens_per_decode_worker: int = 0
    """KV blocks x block size of one decode worker (0: unknown)."""
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None


@dataclass(frozen=True)
class Recommendation:
    prefill: int
    decode: int
    reasons: dict[str, str]
    """Per role, the one line that decided its count."""
    arithmetic: tuple[str, ...]
    """Every step, in order, as text."""


def _ceil(x: float) -> int:
    return math.ceil(round(x, 9))  # 2.0000000001 from float noise is 2, not 3


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _bounded(role: str, need: int, why: str, settings: PlanSettings, lines: list[str]) -> tuple[int, str]:
    count = settings.bounds.clamp(role, need)
    if count != need:
        why = (f"{why}; held to {'min' if count > need else 'max'} {count} "
               f"(--autoscale-{'min' if count > need else 'max'}-{role})")
    lines.append(f"{role}: recommend {count} (min {settings.bounds.low(role)}, max {settings.bounds.high(role)})")
    return count, why


def plan_prefill(i: PlanInputs, settings: PlanSettings, lines: list[str]) -> tuple[int, str]:
    """The prefill count and the reason; appends the arithmetic to `lines`."""
    arriving = max(i.prompt_tokens_per_s, i.prefill_computed_tokens_per_s)
    demand = arriving + i.queued_prefill_tokens / i.window_s
    lines.append(f"prefill: prompt tokens arrive at {arriving:.1f} tok/s (the larger of {i.prompt_tokens_per_s:.1f} "
                 f"at this router and {i.prefill_computed_tokens_per_s:.1f} computed by the prefill workers), "
                 f"+ {i.queued_prefill_tokens} queued / {i.window_s:g} s window = {demand:.1f} tok/s")
    if demand <= 0:
        return _bounded("prefill", 0, "idle: no prompt tokens arrived or queued", settings, lines)
    rate = i.prefill_tokens_per_busy_s
    if rate is None or rate <= 0:
        lines.append("prefill: no prefill throughput measured yet")
        return _bounded("prefill", i.current_prefill, "no prefill throughput measured yet: keep the current count",
                        settings, lines)
    usable = rate * settings.target_utilization
    need = _ceil(demand / usable)
    lines.append(f"prefill: one prefill worker computes {rate:.1f} tok/s busy; at {_pct(settings.target_utilization)} "
                 f"target utilisation {usable:.1f} tok/s")
    lines.append(f"prefill: ceil({demand:.1f} / {usable:.1f}) = {need} prefill workers")
    why = f"{demand:.1f} prompt tok/s over {usable:.1f} tok/s per worker"
    slo = settings.slo_ttft_ms
    if slo is not None and i.ttft_p99_ms is not None and i.ttft_p99_ms > slo:
        busy = i.prefill_utilization >= settings.target_utilization
        lines.append(f"prefill: TTFT p99 {i.ttft_p99_ms:.0f} ms > SLO {slo:g} ms; prefill workers "
                     f"{_pct(i.prefill_utilization)} busy" + (f": at least {i.current_prefill} + 1" if busy
                                                             else " (below target: not the prefill side)"))
        if busy and i.current_prefill + 1 > need:
            need, why = i.current_prefill + 1, f"TTFT p99 {i.ttft_p99_ms:.0f} ms over the {slo:g} ms SLO"
    return _bounded("prefill", need, why, settings, lines)


def plan_decode(i: PlanInputs, settings: PlanSettings, lines: list[str]) -> tuple[int, str]:
    """The decode count and the reason; appends the arithmetic to `lines`."""
    output = max(i.output_tokens_per_s, i.decode_generated_tokens_per_s)
    lines.append(f"decode: output tokens arrive at {output:.1f} tok/s (the larger of {i.output_tokens_per_s:.1f} at "
                 f"this router and {i.decode_generated_tokens_per_s:.1f} generated by the decode workers); "
                 f"{i.decode_running:.1f} requests in decode batches")
    if output <= 0 and i.decode_running <= 0:
        return _bounded("decode", 0, "idle: no output tokens arrived, no request decoding", settings, lines)
    rate = i.decode_tokens_per_busy_s
    if rate is None or rate <= 0:
        lines.append("decode: no decode throughput measured yet")
        return _bounded("decode", i.current_decode, "no decode throughput measured yet: keep the current count",
                        settings, lines)
    candidates = [_decode_by_rate(output, i.decode_batch, settings, rate, lines)]
    candidates += [c for c in (_decode_by_itl(i, settings, lines), _decode_by_kv(i, settings, lines)) if c]
    need, why = max(candidates, key=lambda c: c[0])
    return _bounded("decode", need, why, settings, lines)


def _decode_by_rate(output: float, batch: float, settings: PlanSettings, rate: float,
                    lines: list[str]) -> tuple[int, str]:
    usable = rate * settings.target_utilization
    need = _ceil(output / usable)
    lines.append(f"decode: one decode worker generates {rate:.1f} tok/s busy at a batch of {batch:.1f}; "
                 f"at {_pct(settings.target_utilization)} target utilisation {usable:.1f} tok/s")
    lines.append(f"decode: ceil({output:.1f} / {usable:.1f}) = {need} decode workers")
    return need, f"{output:.1f} output tok/s over {usable:.1f} tok/s per worker"


def _decode_by_itl(i: PlanInputs, settings: PlanSettings, lines: list[str]) -> tuple[int, str] | None:
    slo = settings.slo_itl_ms
    if slo is None or i.itl_p99_ms is None or i.itl_p99_ms <= slo:
        return None
    if i.decode_utilization < settings.target_utilization:
        lines.append(f"decode: ITL p99 {i.itl_p99_ms:.0f} ms > SLO {slo:g} ms but decode workers only "
                     f"{_pct(i.decode_utilization)} busy: not the decode side")
        return None
    streams = max(1, math.floor(i.decode_batch * slo / i.itl_p99_ms))
    need = _ceil(i.decode_running / streams)
    lines.append(f"decode: ITL p99 {i.itl_p99_ms:.0f} ms > SLO {slo:g} ms: one worker holds "
                 f"max(1, floor({i.decode_batch:.1f} x {slo:g} / {i.itl_p99_ms:.0f})) = {streams} streams; "
                 f"ceil({i.decode_running:.1f} / {streams}) = {need}")
    return need, f"ITL p99 {i.itl_p99_ms:.0f} ms over the {slo:g} ms SLO"


def _decode_by_kv(i: PlanInputs, settings: PlanSettings, lines: list[str]) -> tuple[int, str] | None:
    if i.kv_tokens_per_decode_worker <= 0 or i.mean_request_tokens <= 0:
        return None
    concurrency = i.kv_tokens_per_decode_worker / i.mean_request_tokens
    usable = concurrency * settings.target_utilization
    need = _ceil(i.decode_running / usable)
    lines.append(f"decode: one worker's KV holds {i.kv_tokens_per_decode_worker} tokens / {i.mean_request_tokens:.0f} "
                 f"per request = {concurrency:.1f} requests; ceil({i.decode_running:.1f} / {usable:.1f}) = {need}")
    return need, f"{i.decode_running:.1f} decoding requests over a KV concurrency of {usable:.1f} per worker"


def recommend(inputs: PlanInputs, settings: PlanSettings) -> Recommendation:
    """Prefill and decode counts for these measurements, each with its reason and arithmetic."""
    lines: list[str] = []
    prefill, prefill_why = plan_prefill(inputs, settings, lines)
    decode, decode_why = plan_decode(inputs, settings, lines)
    return Recommendation(prefill, decode, {"prefill": prefill_why, "decode": decode_why}, tuple(lines))
