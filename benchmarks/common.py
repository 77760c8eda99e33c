"""Small helpers shared by the benchmark scripts: where a run happened, and recording it.

Every benchmark appends one section to benchmarks/RESULTS.md with the same header lines
(date, machine, commit, versions, exact command), so runs stay comparable over time.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_PATH = BENCH_DIR / "RESULTS.md"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def cpu_model_name() -> str:
    """`Model name` from lscpu (falls back to /proc/cpuinfo, then platform.processor())."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the host's total)."""
    return len(os.sched_getaffinity(0))


def machine_description() -> str:
    return f"{cpu_model_name()}, {usable_cores()} cores ({platform.machine()}, {platform.system()})"


def git_commit() -> str:
    """Short HEAD hash with '-dirty' when the tree has changes; 'none' before the first commit."""
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "none (no commits yet)"
    try:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        dirty = False
    return head + ("-dirty" if dirty else "")


def versions() -> str:
    parts = [f"python {platform.python_version()}"]
    for name in ("torch", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            parts.append(f"{name} {module.__version__}")
    return ", ".join(parts)


def command_line() -> str:
    """The exact command this process was started with, ready to paste into a shell."""
    return shlex.join([sys.executable, *sys.argv])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width table for the terminal."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in cells[1:]])


def run_header() -> list[str]:
    """The lines every RESULTS.md section starts with."""
    return [
        f"- date: {utc_now()}",
        f"- machine: {machine_description()}",
        f"- commit: {git_commit()}",
        f"- versions: {versions()}",
        f"- command: `{command_line()}`",
    ]


def append_results(title: str, body: str, path: Path = RESULTS_PATH) -> Path:
    """Append `## title` + the run header + body to RESULTS.md (created with a title if new)."""
    section = "\n".join([f"## {title}", "", *run_header(), "", body.rstrip(), "", ""])
    if not path.exists():
        path.write_text("# Benchmark results\n\nOne section per run, newest last.\n\n")
    with path.open("a") as f:
        f.write(section)
    return path


def decode_steps_ms(engine, prompts: Sequence[Sequence[int]], params, tag: str) -> list[float]:
    """Add `prompts` to `engine` (an LLMEngine) at once and step it until they finish: the
    steps in which every one of them decodes, in ms (empty if there was none)."""
    import time

    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", list(prompt), params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        if len(outputs) == len(prompts) and all(len(o.token_ids) > 1 for o in outputs):
            steps.append(seconds * 1e3)  # a decode step of the whole batch
    return steps


def median_decode_step_ms(engine, prompts: Sequence[Sequence[int]], params, tag: str) -> float:
    """The median of decode_steps_ms (nan if there was none)."""
    import statistics

    steps = decode_steps_ms(engine, prompts, params, tag)
    return statistics.median(steps) if steps else float("nan")


def report_tables(tables: Sequence[tuple[Sequence[str], Sequence[Sequence[object]]]], title: str,
                  method: Sequence[str], write: bool, findings: Sequence[str] = ()) -> None:
    """Print each (headers, rows) table and the `findings` lines (what the tables add up to);
    when `write`, append them and the method lines to RESULTS.md under `title`, the findings
    between the tables and "Method:"."""
    for headers, rows in tables:
        print(text_table(headers, rows), flush=True)
    if findings:
        print("\n".join(findings), flush=True)
    if not write:
        return
    parts = [markdown_table(headers, rows) + "\n" for headers, rows in tables]
    found = [*findings, ""] if findings else []
    print("appended to", append_results(title, "\n".join([*parts, *found, "Method:", "", *method])))
