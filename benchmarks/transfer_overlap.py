"""How much of a KV transfer the layer-by-layer send hides behind the prefill's compute
(a section of benchmarks/transfer_bandwidth.py, which owns the D child and the gloo channel).

Per prompt size and repeat, P (this process) runs a real prefill of a fresh random prompt on an
EngineCore of the default model, then gets its KV to D (the child) two ways, back to back:

- one-shot: after the step that samples the first token, pack_blocks + send (the old path);
- layered: a LayerFeed opened on the channel before the last chunk's forward pass, each layer
  put by the runner's step listener as soon as it is stored, the first token in the trailer
  (what prefill_worker/layer_stream.py does).

tail = first token sampled on P -> D's poll() returns the complete KV (CLOCK_MONOTONIC, shared
by both processes). hidden share = 1 - tail(layered) / tail(one-shot), medians: the part of the
transfer (packing included) no longer on the request's path to its first token.

The layered transfer's own numbers, as P's TransferResult reports them (what timelines and the
dashboard show): open = doorbell -> ack, the prefill's forward pass and sampling included;
wire = open less the sender's waits for the next layer or the first token with every send it
had posted done; wire GB/s = bytes / wire (the channel's speed, comparable to the one-shot rows).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

OVERLAP_KV_MEMORY = 512 << 20


@dataclass
class OverlapResult:
    tokens: int
    chunks: int
    compute_s: list[float]
    tail_oneshot_s: list[float]
    tail_layered_s: list[float]
    nbytes: int = 0
    open_layered_s: list[float] = field(default_factory=list)
    """P's TransferResult.seconds of the layered transfer (doorbell -> ack)."""
    wire_layered_s: list[float] = field(default_factory=list)
    """P's TransferResult.wire_seconds of the layered transfer."""

    @property
    def hidden(self) -> float:
        med = statistics.median
        return 1 - med(self.tail_layered_s) / med(self.tail_oneshot_s)

    @property
    def wire_gbps(self) -> float:
        wire = statistics.median(self.wire_layered_s) if self.wire_layered_s else 0.0
        return self.nbytes / wire / 1e9 if wire > 0 else 0.0


class OverlapBench:
    """A prefill-mode EngineCore whose runner can stream the next request's layers to D."""

    def __init__(self, sender, child, tickets, seed: int) -> None:
        from engine.config import EngineConfig
        from engine.core import EngineCore
        from engine.loader.locate import default_model_path

        self.core = EngineCore(EngineConfig(model=str(default_model_path()), dtype="float32",
                                            kv_cache_memory=OVERLAP_KV_MEMORY, enable_prefix_caching=False),
                               hold_finished_blocks=True)
        self.core.runner.set_step_listener(self._before_forward)
        self.sender, self.child, self.tickets = sender, child, tickets
        self.rng = random.Random(seed)
        self._want: tuple[str, int] | None = None  # (request id, ticket) to stream
        self._feed = None

    def _before_forward(self, plan):
        from kv_transfer.base import TransferHeader
        from kv_transfer.layers import LayerFeed
        from kv_transfer.packing import block_index, dtype_code, pack_layer

        work = next((w for w in plan.scheduled if self._want and w.request_id == self._want[0] and w.sample), None)
        if work is None:
            return None
        caches = self.core.kv_caches
        _, _, block_size, heads, dim = caches[0].shape
        self._feed = LayerFeed(TransferHeader(self._want[1], 0, len(caches), len(work.block_ids), block_size,
                                              heads, dim, dtype_code(caches[0].dtype)))
        self.sender.send_layers(self._feed)
        index = block_index(work.block_ids, caches)
        return lambda layer: self._feed.put(layer, pack_layer(caches[layer], index))

    def once(self, tokens: int, layered: bool) -> tuple[float, float, int, object]:
        """(prefill compute s, tail s, steps, P's TransferResult) of one fresh prompt."""
        from engine.request import Request
        from engine.sampling_params import SamplingParams
        from kv_transfer.packing import make_header, pack_blocks

        rid, ticket = f"o{next(self.tickets)}", next(self.tickets)
        prompt = tuple(self.rng.randrange(1000, 40000) for _ in range(tokens))
        self._want = (rid, ticket) if layered else None
        self.child.ask("ours")
        start = time.perf_counter()
        self.core.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1), frozenset()))
        outputs, steps = [], 0
        while not outputs:
            outputs = [o for o in self.core.step() if o.request_id == rid and o.new_token_ids]
            steps += 1
        first = outputs[0]
        sampled = time.perf_counter()
        if layered:
            self.core.release_blocks(rid)
            self._feed.finish(first.new_token_ids[0], first.sampled_at)
        else:
            payload = pack_blocks(self.core.kv_caches, self.core.held_block_ids(rid))
            self.core.release_blocks(rid)
            self.sender.send(make_header(ticket, first.new_token_ids[0], payload, first.sampled_at), payload)
        _, _, state, _, _, polled, error = self.child.answer()
        if state != "done":
            raise RuntimeError(f"ticket {ticket} failed on D: {error}")
        while not (results := self.sender.poll()):
            time.sleep(0.001)
        return sampled - start, polled - sampled, steps, results[0]

    def measure(self, tokens: int, repeat: int) -> OverlapResult:
        self.once(tokens, layered=True)  # warm-up
        result = OverlapResult(tokens, 0, [], [], [])
        for run in range(repeat):
            compute, one_tail, steps, _ = self.once(tokens, layered=False)
            _, layered_tail, _, sent = self.once(tokens, layered=True)
            result.chunks, result.nbytes = steps, sent.nbytes
            result.open_layered_s.append(sent.seconds)
            result.wire_layered_s.append(sent.wire_seconds if sent.wire_seconds is not None else sent.seconds)
            result.compute_s.append(compute)
            result.tail_oneshot_s.append(one_tail)
            result.tail_layered_s.append(layered_tail)
            print(f"  overlap {tokens} tokens run {run + 1}/{repeat}: prefill {compute * 1e3:.0f} ms, "
                  f"first token -> KV at D: one-shot {one_tail * 1e3:.1f} ms, layered {layered_tail * 1e3:.1f} ms; "
                  f"layered open {sent.seconds * 1e3:.1f} ms, on the wire {result.wire_layered_s[-1] * 1e3:.1f} ms",
                  flush=True)
        return result


OVERLAP_HEADERS = ["prompt tokens", "prefill steps (chunks)", "prefill ms", "one-shot: token -> KV at D ms",
                   "layered: token -> KV at D ms", "share of transfer hidden", "one-shot per run ms",
                   "layered per run ms", "layered: open ms (doorbell -> ack)", "layered: wire ms", "layered: wire GB/s"]


def overlap_rows(results: list[OverlapResult]) -> list[list[str]]:
    med = statistics.median
    per_run = lambda xs: " / ".join(f"{x * 1e3:.1f}" for x in xs)  # noqa: E731
    return [[r.tokens, r.chunks, f"{med(r.compute_s) * 1e3:.0f}", f"{med(r.tail_oneshot_s) * 1e3:.1f}",
             f"{med(r.tail_layered_s) * 1e3:.1f}", f"{r.hidden:.0%}", per_run(r.tail_oneshot_s),
             per_run(r.tail_layered_s), f"{med(r.open_layered_s) * 1e3:.1f}", f"{med(r.wire_layered_s) * 1e3:.1f}",
             f"{r.wire_gbps:.2f}"] for r in results]


def run_overlap(sender, child, tickets, sizes: list[int], repeat: int, seed: int) -> list[OverlapResult]:
    torch.manual_seed(seed)
    bench = OverlapBench(sender, child, tickets, seed)
    return [bench.measure(tokens, repeat) for tokens in sizes]
