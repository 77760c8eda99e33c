"""Engine flags shared by every command that runs an engine (vLLM's names and meanings)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import DEVICES, DTYPES, KV_CACHE_DTYPES, EngineConfig


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "k": 10**3, "m": 10**6, "g": 10**9,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1, "": 1}
    raw = text.strip().lower()
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):].strip()
    if unit not in units or not number:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(number) * units[unit])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--tokenizer", default=None, help="tokenizer source if not the model's")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", choices=DTYPES, default="auto")
    g.add_argument("--device", choices=DEVICES, default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of device memory (CPU: of available memory) for weights + KV cache")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache budget, e.g. 2GiB (CPU default: 2GiB)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--swap-space", type=float, default=0,
                   help="GiB of host memory per worker for swapped-out KV blocks (0: preempt by recompute)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cpu-packed-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="on CPU, run linears on oneDNN-packed weights (faster; last bits differ from F.linear)")
    g.add_argument("--config", type=Path, default=None, help="YAML file of flag values (flags win)")


def engine_config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """Flags given on the command line override the YAML --config file, which overrides defaults."""
    values = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    values["weights_cache_dir"] = None
    if args.config is not None:
        import yaml

        loaded = yaml.safe_load(args.config.read_text()) or {}
        file_values = {str(k).replace("-", "_"): v for k, v in loaded.items()}
        unknown = sorted(set(file_values) - EngineConfig.field_names())
        if unknown:
            parser.error(f"{args.config}: unknown setting(s) {', '.join(unknown)}")
        for name, value in file_values.items():
            if values.get(name) == parser.get_default(name):
                values[name] = value
    try:
        return EngineConfig(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
