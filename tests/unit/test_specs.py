"""Component specs: validation, the flags <-> spec round trip, and --config YAML files."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from pdserve.cli import build_parser, parse_command_line
from pdserve.specs import RouterSpec, WorkerSpec

ROOT = Path(__file__).resolve().parents[2]


def test_worker_spec_rejects_bad_values_naming_the_field():
    cases = [
        (dict(role="both"), "role must be one of prefill, decode; got 'both'"),
        (dict(role="decode", port=70000), "port must be 0..65535; got 70000"),
        (dict(role="decode", heartbeat_interval_s=0), "heartbeat_interval_s must be > 0; got 0"),
        (dict(role="decode", heartbeat_ttl_s=1.0), "heartbeat_ttl_s (1.0) must exceed heartbeat_interval_s (1.0), "
                                                   "or a live worker's entry expires"),
        (dict(role="decode", drain_timeout_s=-1), "drain_timeout_s must be >= 0; got -1"),
        (dict(role="decode", cluster=""), "cluster must not be empty"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            WorkerSpec(**kwargs)
        assert str(info.value) == message


def test_router_spec_rejects_bad_values_naming_the_field():
    cases = [
        (dict(policy="random"), "policy must be one of cache_aware, least_loaded, round_robin; got 'random'"),
        (dict(grpc_port=-1), "grpc_port must be 0..65535; got -1"),
        (dict(max_replicas=-2), "max_replicas must be >= 0; got -2"),
        (dict(ticket_timeout_s=0.0), "ticket_timeout_s must be > 0; got 0.0"),
        (dict(max_model_len=0), "max_model_len must be > 0; got 0"),
        (dict(scaler=""), 'scaler must be "none" or a scaler name; got ""'),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            RouterSpec(**kwargs)
        assert str(info.value) == message


def test_router_spec_defaults_are_the_router_flags_defaults():
    assert RouterSpec.from_args(build_parser().parse_args(["router"])) == RouterSpec()


def test_router_spec_round_trips_through_its_argv():
    spec = RouterSpec(host="0.0.0.0", port=8100, grpc_port=0, redis_url="redis://10.0.0.5:6379/0", cluster="c1",
                      model="/m/model.gguf", tokenizer="/m/tok", served_model_name="smol", max_model_len=2048,
                      ticket_timeout_s=12.5, colocated=True, policy="least_loaded", prefill_queue_weight=0.25,
                      local_prefill_max_tokens=64, local_prefill_min_queue=512, max_queued_requests=32,
                      max_queue_wait_s=5.0, max_request_bytes=1 << 20, max_n=8, prefill_timeout_s=20.0,
                      stream_idle_timeout_s=9.0, ready_file="/tmp/r.ready", log_level="DEBUG", worker_link=False)
    assert RouterSpec.from_args(build_parser().parse_args(spec.to_argv())) == spec
    assert spec.to_argv()[spec.to_argv().index("--worker-link") + 1] == "false"
    assert "--worker-link" not in RouterSpec().to_argv()  # the default: a router of an older release takes it


def test_pdserve_up_passes_worker_link_false_on_to_its_router():
    args = build_parser().parse_args(["up", "--worker-link", "false"])
    assert args.worker_link is False and RouterSpec.from_args(args).worker_link is False


def test_router_spec_round_trips_its_planner_settings_and_passes_none_by_default():
    spec = RouterSpec(scaler="local", slo_ttft_ms=1500.0, slo_itl_ms=80.0, plan_window_s=20.0,
                      plan_target_utilization=0.7, autoscale=True, autoscale_interval_s=2.0, autoscale_cooldown_s=10.0,
                      autoscale_min_prefill=1, autoscale_max_prefill=3, autoscale_min_decode=2, autoscale_max_decode=5)
    assert RouterSpec.from_args(build_parser().parse_args(spec.to_argv())) == spec
    assert not [part for part in RouterSpec().to_argv() if part.startswith(("--slo", "--plan", "--autoscale"))]


def test_router_spec_refuses_planner_bounds_the_wrong_way_round():
    with pytest.raises(ValueError) as info:
        RouterSpec(autoscale_min_decode=3, autoscale_max_decode=2)
    assert str(info.value) == "autoscale decode bounds must satisfy 0 <= min <= max, max >= 1; got min 3, max 2"


def test_router_spec_names_its_scaler_only_when_one_is_set():
    assert "--scaler" not in RouterSpec().to_argv()
    argv = RouterSpec(scaler="local", max_replicas=4).to_argv()
    assert argv[argv.index("--scaler") + 1] == "local"
    assert argv[argv.index("--max-replicas") + 1] == "4"


def test_worker_spec_round_trips_through_its_argv():
    engine = EngineConfig(model="/m/tiny", tokenizer="/m/tok", dtype="float32", max_model_len=512, block_size=32,
                          kv_cache_memory=256 << 20, enable_prefix_caching=False, max_num_seqs=8, num_threads=1,
                          seed=7, cpu_packed_weights=False)
    spec = WorkerSpec(role="prefill", engine=engine, worker_id="prefill-3", port=5001, metrics_port=5002, link_port=5003,
                      redis_url="redis://127.0.0.1:6379/0", cluster="c1", transfer_timeout_s=9.0,
                      heartbeat_interval_s=0.5, heartbeat_ttl_s=2.0, kv_snapshot_interval_s=3.0,
                      drain_timeout_s=15.0, ready_file="/tmp/p.ready", log_level="DEBUG")
    assert WorkerSpec.from_args(build_parser().parse_args(spec.to_argv())) == spec


def test_config_file_values_are_parsed_as_their_flags_and_command_line_flags_win(tmp_path):
    config = tmp_path / "up.yaml"
    config.write_text("kv-cache-memory: 1GiB\nmax_num_seqs: 8\nenable-prefix-caching: false\n"
                      "prefill: 2\ncolocated: true\npolicy: round_robin\n")
    args = parse_command_line(build_parser(), ["up", "--config", str(config), "--max-num-seqs", "4"])
    assert (args.kv_cache_memory, args.max_num_seqs, args.enable_prefix_caching) == (1 << 30, 4, False)
    assert (args.prefill, args.colocated, args.policy) == (2, True, "round_robin")


def test_router_takes_a_config_file_too(tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text("colocated: true\nmax-queue-wait: 2.5\nport: 9000\n")
    spec = RouterSpec.from_args(parse_command_line(build_parser(), ["router", "--config", str(config)]))
    assert spec == RouterSpec(colocated=True, max_queue_wait_s=2.5, port=9000)


def test_worker_config_file_builds_the_same_spec_as_its_flags(tmp_path):
    config = tmp_path / "decode.yaml"
    config.write_text("kv-cache-memory: 256MiB\nworker-id: decode-7\nheartbeat-interval: 0.5\n")
    from_file = parse_command_line(build_parser(), ["decode", "--config", str(config)])
    from_flags = build_parser().parse_args(["decode", "--kv-cache-memory", "256MiB", "--worker-id", "decode-7",
                                            "--heartbeat-interval", "0.5"])
    assert WorkerSpec.from_args(from_file) == WorkerSpec.from_args(from_flags)
    assert WorkerSpec.from_args(from_file).engine.kv_cache_memory == 256 << 20


def run_pdserve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("text, message", [
    ("kv-cache-memory: 1GiB\ngpus: 2\n", "unknown key 'gpus' (known: api-key, autoscale, autoscale-cooldown, "),
    ("kv-cache-memory: lots\n", "kv-cache-memory: not a size: 'lots' (e.g. 2GiB, 512MiB, 1000000)"),
    ("max-num-seqs: many\n", "max-num-seqs: invalid int value: 'many'"),
    ("dtype: float64\n", "dtype: invalid choice 'float64' (choose from auto, float32, bfloat16, float16)"),
    ("enable-prefix-caching: 3\n", "enable-prefix-caching: expected true or false, got 3"),
    ("- a\n- b\n", "expected a mapping of flag names to values, got list"),
])
def test_a_bad_config_file_is_one_line_naming_the_key_and_exit_2(tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    result = run_pdserve("up", "--config", str(config))
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"pdserve up: --config {config}: {message}")


def test_a_missing_config_file_is_one_line_naming_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    result = run_pdserve("decode", "--config", str(missing))
    assert (result.returncode, result.stderr) == (2, f"pdserve decode: --config {missing}: no such file\n")


def test_specs_hold_no_secrets():
    names = {f.name for spec in (RouterSpec, WorkerSpec) for f in dataclasses.fields(spec)}
    assert not names & {"api_key", "admin_key", "secret", "cluster_secret", "redis_password", "password"}
    assert not any(set(name.split("_")) & {"key", "secret", "password"} for name in names)


def test_router_spec_passes_router_workers_only_when_more_than_one():
    assert "--router-workers" not in RouterSpec().to_argv()
    argv = RouterSpec(router_workers=3).to_argv()
    assert argv[argv.index("--router-workers") + 1] == "3"
    assert RouterSpec.from_args(build_parser().parse_args(argv)) == RouterSpec(router_workers=3)
    assert RouterSpec.from_args(build_parser().parse_args(["up", "--router-workers", "2"])).router_workers == 2
    with pytest.raises(ValueError, match="router_workers must be >= 1; got 0"):
        RouterSpec(router_workers=0)


@pytest.mark.parametrize("link_port, ok", [(0, True), (-1, True), (50052, True), (-2, False), (65536, False)])
def test_a_worker_link_port_is_a_port_zero_for_any_or_minus_one_for_none(link_port, ok):
    if ok:
        assert WorkerSpec(role="decode", link_port=link_port).link_port == link_port
        return
    with pytest.raises(ValueError, match=f"link_port must be 0..65535, or -1 for no link; got {link_port}"):
        WorkerSpec(role="decode", link_port=link_port)
