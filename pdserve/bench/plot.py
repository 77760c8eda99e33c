"""--plot: PNG charts of a run (needs matplotlib: `pip install 'pdserve[bench]'`).

  <stem>.latency_cdf.png   CDF of TTFT, TPOT, ITL and E2EL (ms), one panel each
  <stem>.tokens_per_s.png  output tokens per second of the run, and requests in flight
"""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.client import RequestOutput
from pdserve.bench.metrics import BenchmarkMetrics, tpot_s


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'pdserve[bench]'") from exc
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def latency_samples_ms(outputs: list[RequestOutput]) -> dict[str, list[float]]:
    ok = [o for o in outputs if o.success]
    return {
        "TTFT": [o.ttft * 1e3 for o in ok],
        "TPOT": [tpot_s(o) * 1e3 for o in ok if o.output_tokens > 1],
        "ITL": [g * 1e3 for o in ok for g in o.itl],
        "E2EL": [o.latency * 1e3 for o in ok],
    }


def in_flight_per_second(outputs: list[RequestOutput], seconds: int) -> list[int]:
    ok = [o for o in outputs if o.success]
    if not ok:
        return [0] * seconds
    origin = min(o.start_time for o in ok)
    return [sum(o.start_time - origin <= s + 0.5 < o.start_time - origin + o.latency for o in ok)
            for s in range(seconds)]


def write_plots(outputs: list[RequestOutput], metrics: BenchmarkMetrics, stem: Path) -> list[Path]:
    """Write both PNGs next to `stem` (a path without suffix); returns their paths."""
    plt = _pyplot()
    stem.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, latency_samples_ms(outputs).items()):
        values = sorted(values)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], drawstyle="steps-post")
        ax.set(title=f"{name} CDF ({len(values)} samples)", xlabel="ms", ylabel="fraction <= x")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf = stem.with_name(stem.name + ".latency_cdf.png")
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    per_second = list(metrics.tokens_per_second)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(range(len(per_second)), per_second, marker=".", label="output tokens/s")
    ax.set(xlabel="seconds since the first request", ylabel="tokens/s", title="Output tokens per second")
    twin = ax.twinx()
    twin.plot(range(len(per_second)), in_flight_per_second(outputs, len(per_second)), color="tab:orange",
              alpha=0.6, label="requests in flight")
    twin.set_ylabel("requests in flight")
    fig.legend(loc="upper right")
    fig.tight_layout()
    rate = stem.with_name(stem.name + ".tokens_per_s.png")
    fig.savefig(rate, dpi=100)
    plt.close(fig)
    return [cdf, rate]
