"""`pdserve bench`: a load generator flag-compatible with `vllm bench serve`.

Parts: args (flags), datasets (prompts of exact token lengths), arrivals (Poisson/gamma send
times), client (one streamed OpenAI request over aiohttp), sse (stream parsing), runner (send
them all, collect outputs), metrics (vLLM's numbers), report (the printed block and the JSON),
plot (optional PNG charts), main (the command).

Library use (benchmarks/router_overhead.py): build `SampleRequest`s, then
`asyncio.run(run_benchmark(RunSettings(...), requests))` -> `RunResult`, and
`compute_metrics(result.outputs, result.duration_s, ...)`.
"""

import importlib

_EXPORTS = {
    "SampleRequest": "pdserve.bench.datasets",
    "BenchmarkMetrics": "pdserve.bench.metrics",
    "compute_metrics": "pdserve.bench.metrics",
    "RunResult": "pdserve.bench.runner",
    "RunSettings": "pdserve.bench.runner",
    "run_benchmark": "pdserve.bench.runner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # Lazy, so `pdserve --help` (which reads pdserve.bench.args) does not import aiohttp or numpy.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve.bench' has no attribute {name!r}")
