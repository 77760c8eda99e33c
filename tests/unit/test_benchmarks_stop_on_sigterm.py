"""Every benchmark script that starts processes turns SIGTERM into SystemExit first
(benchmarks.peers.servers.exit_on_sigterm), so its `finally` and `with` blocks stop the clusters,
routers and doubles it started. Before, a router_overhead.py stopped with SIGTERM mid-run left its
router, both doubles and its temp folder behind."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
STARTS_PROCESSES = ("subprocess.Popen", "start_pdserve_up", "Processes(", "start_doubles", "start_routers",
                    "multiprocessing")


def _main_calls(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return set()


def test_every_script_that_starts_processes_exits_cleanly_on_sigterm():
    scripts = [p for p in sorted(BENCHMARKS.glob("*.py"))
               if "__main__" in (text := p.read_text()) and any(s in text for s in STARTS_PROCESSES)]
    assert len(scripts) >= 7, scripts
    missing = [p.name for p in scripts if "exit_on_sigterm" not in _main_calls(ast.parse(p.read_text()))]
    assert not missing, f"main() does not call exit_on_sigterm(): {missing}"
