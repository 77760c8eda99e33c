"""`pdserve prefill|decode` flags <-> WorkerSpec: WorkerSpec.to_argv() parsed by the worker's own
parser gives back an equal spec (the one place a spec becomes a command line, and its inverse)."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig
from pdserve.cli import build_parser
from pdserve.specs import WorkerSpec
from pdserve.worker_main import worker_spec_from_args


def subparser(role: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._subparsers._group_actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[role]


def parsed_spec(argv: list[str]) -> WorkerSpec:
    args = build_parser().parse_args(argv)
    return worker_spec_from_args(argv[0], args, subparser(argv[0]))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_default_spec_round_trips_through_the_worker_parser(role):
    spec = WorkerSpec(role=role)
    assert parsed_spec(spec.to_argv()) == spec


def test_spec_with_every_setting_changed_round_trips_through_the_worker_parser():
    engine = EngineConfig(
        model="/models/tiny", tokenizer="/models/tok", served_model_name="tiny", dtype="float32", device="cpu",
        max_model_len=512, block_size=32, gpu_memory_utilization=0.5, kv_cache_memory=256 << 20,
        num_gpu_blocks_override=300, kv_cache_dtype="fp8", enable_prefix_caching=False, swap_space=1.5,
        max_num_seqs=8, max_num_batched_tokens=512, num_threads=1, seed=7, cpu_packed_weights=False)
    spec = WorkerSpec(
        role="decode", engine=engine, worker_id="decode-7", host="10.0.0.5", port=50100, metrics_port=9100,
        redis_url="redis://127.0.0.1:6390/0", cluster="blue", kv_transfer="local", transfer_timeout_s=12.5,
        heartbeat_interval_s=0.5, heartbeat_ttl_s=2.0, kv_snapshot_interval_s=3.0, drain_timeout_s=5.0,
        ready_file="/tmp/ready", log_level="DEBUG")
    assert parsed_spec(spec.to_argv()) == spec


def test_drain_timeout_flag_defaults_to_60_seconds():
    assert parsed_spec(["decode"]).drain_timeout_s == 60.0


def test_invalid_worker_setting_exits_with_the_reason(capsys):
    with pytest.raises(SystemExit) as exited:
        parsed_spec(["prefill", "--heartbeat-interval", "5", "--heartbeat-ttl", "2"])
    assert exited.value.code == 2
    assert ("heartbeat_ttl_s (2.0) must exceed heartbeat_interval_s (5.0), or a live worker's entry expires"
            in capsys.readouterr().err)


def test_config_file_engine_settings_reach_the_spec_and_flags_win(tmp_path):
    config = tmp_path / "worker.yaml"
    config.write_text("block-size: 32\nmax-num-seqs: 4\n")
    spec = parsed_spec(["decode", "--config", str(config), "--max-num-seqs", "2", "--drain-timeout", "9"])
    assert (spec.engine.block_size, spec.engine.max_num_seqs, spec.drain_timeout_s) == (32, 2, 9.0)
