"""`pdserve <command> --help`: every flag of every command (walked from build_parser(), so a
command or flag added later is checked too) has a one-line description and shows its default."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import HelpFormatter, build_parser

ROOT = Path(__file__).resolve().parents[2]
UNSHOWN_DEFAULTS = (None, False, argparse.SUPPRESS)
"""Defaults the help leaves out: unset (its text says what that means), a switch that is off, none."""


def commands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return dict(sub.choices)


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]  # noqa: SLF001


def help_entry(help_text: str, action: argparse.Action) -> str:
    """The flag's entry in `--help` output: its invocation line and the lines indented below it,
    joined into one line (the formatter wraps at the terminal width)."""
    lines = help_text.splitlines()
    first = action.option_strings[0]
    [start] = [i for i, line in enumerate(lines)
               if line.startswith("  -") and line.split(",")[0].split()[0] == first]
    entry = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("   ") or line.lstrip().startswith("-"):
            break
        entry.append(line)
    return " ".join(" ".join(entry).split())


def test_the_walk_finds_every_command():
    assert {"generate", "chat", "prefill", "decode", "router", "plan", "bench", "up", "scale"} <= set(commands())


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_uses_the_defaults_formatter_and_has_a_description(name):
    parser = commands()[name]
    assert parser.formatter_class is HelpFormatter
    assert parser.description, f"pdserve {name} has no description"


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_flag_has_a_one_line_description(name):
    missing = [a.option_strings[0] for a in flags(commands()[name])
               if not a.help or a.help == argparse.SUPPRESS or "\n" in a.help]
    assert missing == [], f"pdserve {name}: flags without a one-line help text"


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_flag_with_a_default_shows_it_in_help(name, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    parser = commands()[name]
    text = parser.format_help()
    missing = [a.option_strings[0] for a in flags(parser)
               if a.default not in UNSHOWN_DEFAULTS and f"(default: {a.default})" not in help_entry(text, a)]
    assert missing == [], f"pdserve {name}: flags whose help does not show the default"


def test_unset_and_off_defaults_are_not_printed_as_none_or_false(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    text = commands()["up"].format_help()
    assert "(default: None)" not in text and "(default: False)" not in text
    assert help_entry(text, next(a for a in flags(commands()["up"]) if a.dest == "port")) == (
        "--port PORT OpenAI HTTP port (default: 8000)")


def test_up_help_through_the_real_cli_lists_config_and_shows_defaults():
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert "\n\nrun a whole cluster (local processes, or Ray actors)\n\n" in result.stdout
    words = " ".join(result.stdout.split())
    assert "--config CONFIG YAML file of flag values, keys are the flag names (flags given here win)" in words
    assert "--max-num-seqs MAX_NUM_SEQS most requests in one engine step (default: 256)" in words
