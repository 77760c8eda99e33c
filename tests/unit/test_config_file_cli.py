"""`--config FILE.yaml` on every command that lists it (walked from build_parser()): values parse
as their flags do, and a missing file, an unknown key, a bad value or bad YAML is one line
naming the path or key, exit 2, no traceback, through the real CLI."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import build_parser, parse_command_line

ROOT = Path(__file__).resolve().parents[2]


def commands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return dict(sub.choices)


def commands_with_config() -> list[str]:
    return sorted(name for name, p in commands().items() if "--config" in p._option_string_actions)  # noqa: SLF001


def an_int_flag(name: str) -> str:
    """A flag of the command whose type is int (each command with --config has one)."""
    parser = commands()[name]
    return next(a.option_strings[0][2:] for a in parser._actions if a.type is int and a.option_strings)  # noqa: SLF001


def run_pdserve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_commands_that_list_config_are_the_engine_and_service_commands():
    assert commands_with_config() == ["chat", "decode", "generate", "plan", "prefill", "router", "up"]


@pytest.mark.parametrize("name", [n for n in commands_with_config() if n != "router"])
def test_a_size_in_a_config_file_parses_as_the_flag_does(name, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("kv-cache-memory: 1GiB\nmax_num_seqs: 8\n")
    from_file = parse_command_line(build_parser(), [name, "--config", str(config)])
    from_flags = build_parser().parse_args([name, "--kv-cache-memory", "1GiB", "--max-num-seqs", "8"])
    assert (from_file.kv_cache_memory, from_file.max_num_seqs) == (1 << 30, 8)
    settings = {k: v for k, v in vars(from_file).items() if k != "func"}  # func: a fresh lambda per parser
    assert settings == {k: v for k, v in vars(from_flags).items() if k != "func"} | {"config": config}


@pytest.mark.parametrize("name", commands_with_config())
def test_a_missing_config_file_is_one_line_naming_the_path(name, tmp_path):
    missing = tmp_path / "nope.yaml"
    result = run_pdserve(name, "--config", str(missing))
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"pdserve {name}: --config {missing}: no such file\n")


@pytest.mark.parametrize("name", commands_with_config())
def test_an_unknown_key_is_one_line_naming_it(name, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("gpus: 2\n")
    result = run_pdserve(name, "--config", str(config))
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"pdserve {name}: --config {config}: unknown key 'gpus' (known: ")


@pytest.mark.parametrize("name", commands_with_config())
def test_a_bad_value_is_one_line_naming_the_key(name, tmp_path):
    key = an_int_flag(name)
    config = tmp_path / "c.yaml"
    config.write_text(f"{key}: lots\n")
    result = run_pdserve(name, "--config", str(config))
    assert (result.returncode, result.stderr) == (
        2, f"pdserve {name}: --config {config}: {key}: invalid int value: 'lots'\n")


@pytest.mark.parametrize("name", commands_with_config())
def test_bad_yaml_is_one_line_naming_the_path_and_line(name, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("port: 1\nmodel: [unclosed\n")
    result = run_pdserve(name, "--config", str(config))
    assert (result.returncode, result.stderr) == (2, f"pdserve {name}: --config {config}: not valid YAML at line 3\n")
