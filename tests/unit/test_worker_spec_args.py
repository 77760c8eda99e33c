"""`pdserve prefill|decode` flags <-> WorkerSpec: WorkerSpec.to_argv() run through `pdserve`'s own
command line gives back an equal spec (the one place a spec becomes a command line, and its inverse)."""

from __future__ import annotations

import pytest

import pdserve.worker_main
import worker_runtime.process
from engine.config import EngineConfig
from pdserve.cli import main
from pdserve.specs import WorkerSpec


class CapturedProcess:
    """Stands in for worker_runtime's WorkerProcess (the other side of the seam): records the
    spec the command line produced instead of loading a model."""

    specs: list[WorkerSpec] = []

    def __init__(self, spec: WorkerSpec, secret: bytes) -> None:
        self.specs.append(spec)

    def run(self) -> int:
        return 0


@pytest.fixture(autouse=True)
def captured(monkeypatch) -> list[WorkerSpec]:
    monkeypatch.setattr(worker_runtime.process, "WorkerProcess", CapturedProcess)
    # The specs name models and hosts that do not exist here: the pre-load checks are tested in
    # test_preflight.py and through the CLI in test_cli_preflight.py.
    monkeypatch.setattr(pdserve.worker_main, "preflight", lambda role, spec: None)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # tune_allocator leaves this test process alone
    CapturedProcess.specs = []
    return CapturedProcess.specs


def parsed_spec(argv: list[str]) -> WorkerSpec:
    """The spec `pdserve <argv>` runs, through the real command line (cli.main)."""
    assert main(argv) == 0
    [spec] = CapturedProcess.specs
    return spec


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_default_spec_round_trips_through_the_worker_parser(role):
    spec = WorkerSpec(role=role)
    assert parsed_spec(spec.to_argv()) == spec


def test_spec_with_every_setting_changed_round_trips_through_the_worker_parser():
    engine = EngineConfig(
        model="/models/tiny", tokenizer="/models/tok", served_model_name="tiny", dtype="float32", device="cpu",
        max_model_len=512, block_size=32, gpu_memory_utilization=0.5, kv_cache_memory=256 << 20,
        num_gpu_blocks_override=300, kv_cache_dtype="fp8", enable_prefix_caching=False, swap_space=1.5,
        max_num_seqs=8, max_num_batched_tokens=512, num_threads=1, seed=7, cpu_packed_weights=False,
        decode_threads=2, engine_nice=5, quantization="int8", long_prefill_token_threshold=0, max_long_partial_prefills=3,
        int4_activations="int8", cpu_kv_huge_pages=False)
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
    config.write_text("max-model-len: 512\nkv-cache-memory: 67108864\n")
    spec = parsed_spec(["decode", "--config", str(config), "--max-model-len", "256", "--drain-timeout", "9"])
    assert (spec.engine.max_model_len, spec.engine.kv_cache_memory, spec.drain_timeout_s) == (256, 64 << 20, 9.0)
