"""The chart's commands are real: the CPU example's router, prefill and decode containers
(command, args, env exactly as rendered) run as local processes against a local Redis with a
password, serve the real model with the offline engine's greedy tokens, and a SIGTERM to a
worker (what Kubernetes sends on scale-down, node drain or rollout) drains it: every in-flight
request finishes, none fails, the worker exits 0.

Two local substitutions, both outside what the chart decides: the router's `--scaler
kubernetes` becomes `none` (there is no Kubernetes API here; the scaler's requests are tested
against an API double in tests/service), and the weights cache of the pod's emptyDir is this
machine's (so the GGUF file is dequantized once, not once per pod).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy import pods
from tests.deploy.chart import EXAMPLES, NAMESPACE, RELEASE, find, render
from tests.e2e.cluster import free_ports
from tests.real_model import prompt_token_ids

pytestmark = pytest.mark.slow
FULL = f"{RELEASE}-pdserve"
MODEL = "SmolLM2-135M-Instruct"
SHORT, LONG = 16, 96
"""max_tokens of the greedy comparison, and of the streams in flight when the worker drains."""
NUM_SHORT, NUM_DRAINING = 8, 3
START_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    """The offline engine's greedy tokens, computed before the processes start."""
    from engine import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=1024)
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    short = llm.generate([list(p) for p in prompt_token_ids()[:NUM_SHORT]], greedy(SHORT))
    long = llm.generate([list(p) for p in prompt_token_ids()[NUM_SHORT:NUM_SHORT + NUM_DRAINING]], greedy(LONG))
    del llm
    return [list(o.token_ids) for o in short], [list(o.token_ids) for o in long]


class LocalRelease:
    """The CPU example's rendered pods as local processes around an EmbeddedRedis."""

    def __init__(self, helm: Path, tmp: Path) -> None:
        from pdserve.redis_server import EmbeddedRedis

        self.objects = render(helm, EXAMPLES / "cpu-1p1d.yaml")
        self.tmp = tmp
        self.redis = EmbeddedRedis(password=secrets.token_urlsafe(24)).start()
        self.secrets = {(f"{FULL}-cluster", "cluster-secret"): secrets.token_urlsafe(32),
                        (f"{FULL}-redis", "redis-password"): self.redis.password}
        wanted = [(role, p["containerPort"]) for role in ("router", "prefill", "decode")
                  for p in self.container(role)["ports"]]
        self.ports: dict[str, dict[int, int]] = {}
        for (role, port), local in zip(wanted, free_ports(len(wanted)), strict=True):  # distinct
            self.ports.setdefault(role, {})[port] = local
        self.services = {f"{FULL}-redis": {6379: self.redis.port},
                         f"{FULL}-router": {8000: self.ports["router"][8000], 50051: self.ports["router"][50051]}}
        self.processes: dict[str, object] = {}
        self.argv: dict[str, list[str]] = {}

    def container(self, role: str) -> dict:
        return find(self.objects, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]["containers"][0]

    def start(self, role: str) -> None:
        container = self.container(role)
        pod_tmp = self.tmp / f"{role}-tmp"
        pod_tmp.mkdir()
        pod = pods.Pod(name=f"{FULL}-{role}-0", namespace=NAMESPACE, secrets=self.secrets, tmp=pod_tmp)
        env = pod.env(container)
        env.pop("PDSERVE_CACHE_DIR")  # this machine's weights cache (see the module docstring)
        args = pods.localize(pods.expand(container["args"], env), self.ports[role], self.services)
        if role == "router":
            args[args.index("--scaler") + 1] = "none"
        self.argv[role] = args
        self.processes[role] = pods.start(pods.command(container) + args, env, self.tmp / f"{role}.log")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['router'][8000]}"

    def wait_ready(self, timeout_s: float) -> None:
        """Until the router's /ready is 200 (a prefill and a decode worker serve); bounded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for role, process in self.processes.items():
                if process.poll() is not None:
                    raise AssertionError(f"{role} exited {process.returncode}:\n{self.log(role)[-3000:]}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"not ready in {timeout_s} s:\n" + "\n".join(self.log(r)[-1500:] for r in self.processes))

    def log(self, role: str) -> str:
        return (self.tmp / f"{role}.log").read_text(errors="replace")

    def stop(self) -> None:
        for role in ("router", "prefill", "decode"):
            if role in self.processes:
                pods.stop(self.processes[role])
        self.redis.stop()


@pytest.fixture(scope="module")
def release(helm, reference, tmp_path_factory):
    r = LocalRelease(helm, tmp_path_factory.mktemp("release"))
    try:
        for role in ("prefill", "decode", "router"):
            r.start(role)
        r.wait_ready(START_TIMEOUT_S)
        yield r
    finally:
        r.stop()


def _completion(ids, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": list(ids), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}


def test_rendered_processes_take_their_addresses_from_the_pod_and_services(release):
    prefill = release.argv["prefill"]
    assert prefill[:2] == ["prefill", "--host"] and prefill[2] == "127.0.0.1"
    assert prefill[prefill.index("--advertise-host") + 1] == "127.0.0.1"
    assert prefill[prefill.index("--worker-id") + 1] == f"{FULL}-prefill-0"
    assert prefill[prefill.index("--redis-url") + 1] == f"redis://127.0.0.1:{release.redis.port}/0"
    assert prefill[prefill.index("--port") + 1] == str(release.ports["prefill"][50051])
    assert prefill[prefill.index("--link-port") + 1] == str(release.ports["prefill"][50052])


def test_the_probes_the_chart_names_answer_200_on_the_serving_pods(release):
    for role in ("prefill", "decode"):
        c = release.container(role)
        metrics = release.ports[role][9100]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = c[probe]["httpGet"]["path"]
            r = httpx.get(f"http://127.0.0.1:{metrics}{path}", timeout=10)
            assert r.status_code == 200, f"{role} {path}: {r.status_code} {r.text}"
    router = release.container("router")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        r = httpx.get(release.base_url + router[probe]["httpGet"]["path"], timeout=10)
        assert r.status_code == 200, f"router {probe}: {r.status_code} {r.text}"


def test_the_release_serves_the_offline_engines_greedy_tokens(release, reference):
    want, _ = reference

    async def run():
        async with httpx.AsyncClient(base_url=release.base_url, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=_completion(ids, SHORT))
                                          for ids in prompt_token_ids()[:NUM_SHORT]))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * NUM_SHORT, [r.text for r in responses]
    assert [r.headers["x-pdserve-path"] for r in responses] == ["disaggregated"] * NUM_SHORT
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == want


async def _stream(client: httpx.AsyncClient, ids, started: asyncio.Event) -> tuple[int, list[int], str | None]:
    """One streamed completion: (status, token ids, error text of an in-band error event)."""
    tokens: list[int] = []
    async with client.stream("POST", "/v1/completions", json=_completion(ids, LONG, stream=True)) as r:
        if r.status_code != 200:
            return r.status_code, tokens, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return r.status_code, tokens, json.dumps(event["error"])
            for choice in event.get("choices", []):
                tokens += choice.get("token_ids") or []
            if len(tokens) >= 2:
                started.set()
    return r.status_code, tokens, None


def test_sigterm_drains_the_decode_worker_with_no_failed_request(release, reference):
    _, want = reference
    decode = release.processes["decode"]

    async def run():
        async with httpx.AsyncClient(base_url=release.base_url, timeout=300) as client:
            events = [asyncio.Event() for _ in range(NUM_DRAINING)]
            ids = prompt_token_ids()[NUM_SHORT:NUM_SHORT + NUM_DRAINING]
            tasks = [asyncio.create_task(_stream(client, p, e)) for p, e in zip(ids, events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=180)
            decode.send_signal(signal.SIGTERM)  # what the kubelet sends; no preStop for workers
            in_flight = sum(not t.done() for t in tasks)
            return in_flight, await asyncio.gather(*tasks)

    in_flight, results = asyncio.run(run())
    assert in_flight == NUM_DRAINING, "every stream was still running when the worker got SIGTERM"
    assert [(status, error) for status, _, error in results] == [(200, None)] * NUM_DRAINING
    assert [tokens for _, tokens, _ in results] == want
    assert decode.wait(timeout=90) == 0, release.log("decode")[-3000:]
    workers = httpx.get(release.base_url + "/v1/cluster", timeout=10).json()["workers"]
    assert [w["worker_id"] for w in workers] == [f"{FULL}-prefill-0"]
