"""Every example's rendered router and worker args are a command line pdserve accepts: they
parse with pdserve's own parser into a valid RouterSpec / WorkerSpec (whose validation runs),
and the spec's to_argv (the one place pdserve turns a spec into argv) gives the same spec back.
So a flag the chart misspells, or a value the engine refuses, fails here without a model."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.specs import RouterSpec, WorkerSpec
from tests.deploy import pods
from tests.deploy.chart import EXAMPLES, RELEASE, container, render

FULL = f"{RELEASE}-pdserve"
POD_ENV = {"POD_IP": "10.1.2.3", "POD_NAME": f"{FULL}-decode-7d9f-abcde"}
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def _parse(args: list[str]):
    return build_parser().parse_args(pods.expand(args, POD_ENV))


@pytest.mark.parametrize("values", [None, *EXAMPLE_FILES], ids=lambda v: "default" if v is None else v.stem)
def test_rendered_worker_args_are_a_valid_worker_spec_that_round_trips(helm, values):
    objects = render(helm, *([values] if values else []))
    for role in ("prefill", "decode"):
        spec = WorkerSpec.from_args(_parse(container(objects, role)["args"]))
        assert (spec.role, spec.host, spec.port, spec.metrics_port) == (role, "0.0.0.0", 50051, 9100)
        assert spec.link_port == 50052  # the worker link: a fixed port, named "link" in the pod
        assert {"name": "link", "containerPort": 50052, "protocol": "TCP"} in container(objects, role)["ports"]
        assert spec.worker_id == POD_ENV["POD_NAME"]
        assert WorkerSpec.from_args(_parse(spec.to_argv())) == spec


@pytest.mark.parametrize("values", [None, *EXAMPLE_FILES], ids=lambda v: "default" if v is None else v.stem)
def test_rendered_router_args_are_a_valid_router_spec_that_round_trips(helm, values):
    objects = render(helm, *([values] if values else []))
    spec = RouterSpec.from_args(_parse(container(objects, "router")["args"]))
    assert (spec.host, spec.port, spec.grpc_port) == ("0.0.0.0", 8000, 50051)
    assert RouterSpec.from_args(_parse(spec.to_argv())) == spec


def test_gpu_example_engine_settings_reach_the_worker_spec(helm):
    objects = render(helm, EXAMPLES / "gpu-2p4d-nccl.yaml")
    decode = WorkerSpec.from_args(_parse(container(objects, "decode")["args"]))
    prefill = WorkerSpec.from_args(_parse(container(objects, "prefill")["args"]))
    assert (decode.kv_transfer, decode.drain_timeout_s, prefill.drain_timeout_s) == ("nccl", 300.0, 120.0)
    e = decode.engine
    assert (e.model, e.served_model_name, e.dtype, e.device, e.max_model_len, e.gpu_memory_utilization,
            e.max_num_seqs, e.block_size) == ("/models/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct", "bfloat16",
                                              "cuda", 8192, 0.9, 256, 16)
    assert prefill.engine.max_num_batched_tokens == 8192
    router = RouterSpec.from_args(_parse(container(objects, "router")["args"]))
    assert (router.model, router.served_model_name, router.max_model_len, router.scaler) == (
        "/models/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct", 8192, "kubernetes")


def test_cpu_example_workers_get_a_small_kv_budget_and_their_own_threads(helm):
    objects = render(helm, EXAMPLES / "cpu-1p1d.yaml")
    for role in ("prefill", "decode"):
        e = WorkerSpec.from_args(_parse(container(objects, role)["args"])).engine
        assert (e.device, e.dtype, e.max_model_len, e.num_threads) == ("cpu", "float32", 1024, 2)
        assert container(objects, role)["args"][container(objects, role)["args"].index("--kv-cache-memory") + 1] == "256MiB"


def test_engine_scheduling_quantization_thread_and_cpu_kernel_keys_reach_the_worker_spec(helm):
    objects = render(helm, sets=("engine.quantization=gguf", "engine.decodeThreads=2", "engine.engineNice=5",
                                 "prefill.engine.longPrefillTokenThreshold=512",
                                 "engine.maxLongPartialPrefills=2", "decode.engine.cpuAttentionKernel=false",
                                 "engine.cpuPackedWeights=false", "prefill.engine.cpuInt4Kernel=false",
                                 "decode.engine.int4Activations=bfloat16", "decode.engine.cpuKvHugePages=false"))
    prefill = WorkerSpec.from_args(_parse(container(objects, "prefill")["args"])).engine
    decode = WorkerSpec.from_args(_parse(container(objects, "decode")["args"])).engine
    assert (prefill.quantization, prefill.decode_threads, prefill.long_prefill_token_threshold,
            prefill.max_long_partial_prefills) == ("gguf", 2, 512, 2)
    assert (decode.long_prefill_token_threshold, decode.max_long_partial_prefills) == (None, 2)  # role default
    assert prefill.engine_nice == decode.engine_nice == 5
    assert (prefill.cpu_attention_kernel, decode.cpu_attention_kernel) == (True, False)
    assert "--no-cpu-attention-kernel" in container(objects, "decode")["args"]
    assert prefill.cpu_packed_weights is decode.cpu_packed_weights is False
    assert (prefill.cpu_int4_kernel, decode.cpu_int4_kernel) == (False, True)
    assert "--no-cpu-int4-kernel" in container(objects, "prefill")["args"]
    assert (prefill.int4_activations, decode.int4_activations) == ("auto", "bfloat16")
    assert (prefill.cpu_kv_huge_pages, decode.cpu_kv_huge_pages) == (True, False)
    assert "--no-cpu-kv-huge-pages" in container(objects, "decode")["args"]


def test_router_workers_value_reaches_the_router_spec_only_when_more_than_one(helm):
    args = container(render(helm), "router")["args"]
    assert "--router-workers" not in args and RouterSpec.from_args(_parse(args)).router_workers == 1
    objects = render(helm, sets=("router.workers=3",))
    assert RouterSpec.from_args(_parse(container(objects, "router")["args"])).router_workers == 3
