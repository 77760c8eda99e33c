"""Engine flags shared by every command that runs an engine (vLLM's names and meanings)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import DEVICES, DTYPES, INT4_ACTIVATIONS, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig


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


def parse_redis_url(text: str) -> str:
    """A --redis-url: redis://, rediss:// (TLS) or unix:// (checked here, where a flag's or a
    --config file's value is parsed, rather than by the Redis client once processes run)."""
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    if scheme not in ("redis", "rediss", "unix"):
        raise argparse.ArgumentTypeError(
            f"not a Redis URL: {text!r} (redis://HOST:PORT/DB, rediss://... for TLS, or unix://PATH)")
    return text


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--tokenizer", default=None, help="tokenizer source if not the model's")
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: the model file's name)")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and activations (auto: bfloat16 on GPUs and AVX512-BF16 CPUs, else float32)")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the engine runs (auto: cuda if available, else cpu)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the whole GPU's memory (CPU: of available memory) for weights + KV "
                        "cache (unset: 0.9 on GPU, divided among the workers `pdserve up` starts on it; "
                        "on CPU --kv-cache-memory decides)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache budget, e.g. 2GiB (CPU default: 2GiB)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="exact number of KV blocks (unset: from the memory budget)")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                   help="weight-only int4/int8 linears on CPU (gguf: keep a GGUF's Q4/Q8 blocks; int4/int8: quantize at load; "
                        "auto and none: dense, measured faster with torch's CPU kernels)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache element type (auto: the model dtype)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV blocks of a shared prompt prefix")
    g.add_argument("--swap-space", type=float, default=0,
                   help="GiB of host memory per worker for swapped-out KV blocks (0: preempt by recompute)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one engine step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one engine step (chunked prefill; default: 512 on a CPU prefill worker, "
                        "else 2048)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="prompts longer than this are computed in chunks of at most this many tokens, and short "
                        "prompts may go ahead of them (0: off; default on a prefill worker: 128 on CPU, 256 on "
                        "GPU; else 0)")
    g.add_argument("--max-long-partial-prefills", type=int, default=1,
                   help="most long prompts computed at once; past it, short prompts are admitted first")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--decode-threads", type=int, default=None,
                   help="torch threads for decode steps of at most 4 tokens (default: --num-threads, as prefill)")
    g.add_argument("--engine-nice", type=int, default=None,
                   help="nice steps (0-19) the engine thread runs below the threads that stream tokens "
                        "(default: 10 on CPU, 0 on GPU)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the engine")
    g.add_argument("--cpu-packed-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="on CPU, run linears on oneDNN-packed weights (faster; last bits differ from F.linear)")
    g.add_argument("--cpu-attention-kernel", action=argparse.BooleanOptionalAction, default=True,
                   help="on CPU, run decode attention in pdserve's C kernel, built at start with the host's "
                        "C compiler (default; without a compiler: torch's SDPA)")
    g.add_argument("--cpu-int4-kernel", action=argparse.BooleanOptionalAction, default=True,
                   help="on CPU, run int4 linears (--quantization int4/gguf) in pdserve's C kernel, built at "
                        "start (default; bfloat16 activations need AVX512-BF16, else torch's int4 kernel; int8 ones run on "
                        "AVX2 too)")
    g.add_argument("--cpu-kv-huge-pages", action=argparse.BooleanOptionalAction, default=True,
                   help="on CPU, put the KV cache on 2 MiB pages (transparent huge pages: fewer TLB misses in "
                        "decode attention; can add seconds per GiB at start where free memory is fragmented)")
    g.add_argument("--int4-activations", choices=INT4_ACTIVATIONS, default="auto",
                   help="what the C kernel's int4 linears multiply with: int8 (x quantized per group of 32 as "
                        "llama.cpp does: its numerics, about twice as fast; needs AVX512-VNNI or AVX2 with FMA and "
                        "F16C), bfloat16 (x as it is, the dense model's weights and numerics; needs AVX512-BF16), "
                        "or auto (default: int8 where the CPU runs it, else bfloat16)")
    add_config_arg(g)


def add_config_arg(parser) -> None:
    """--config FILE.yaml: flag values by flag name (pdserve.cli expands it before parsing)."""
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML file of flag values, keys are the flag names (flags given here win)")


def engine_config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """The EngineConfig of the parsed flags (a --config file was already expanded into flags by
    `parse_command_line`); a bad setting ends the program with the parser's error."""
    from pdserve.specs import engine_config_from

    try:
        return engine_config_from(args)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


class ConfigFileError(ValueError):
    """A --config file that cannot be used: the message names the file and the key."""


def config_file_argv(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The flags a YAML --config file stands for, each value checked as the flag itself would
    check it (its type and choices: `kv-cache-memory: 1GiB` is parse_bytes("1GiB")). Keys are
    the parser's flag names without `--` (`-` or `_` alike). Put before the command line's own
    flags, so those win. Raises ConfigFileError naming the path or the key."""
    argv: list[str] = []
    for key, value in _load_mapping(path).items():
        name = str(key).replace("_", "-")
        action = parser._option_string_actions.get("--" + name)  # noqa: SLF001 — argparse's flag table
        if action is None or name == "config":
            raise ConfigFileError(f"{path}: unknown key {key!r} (known: {', '.join(_known_keys(parser))})")
        try:
            argv += _flag_tokens(action, "--" + name, value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ConfigFileError(f"{path}: {key}: {exc}") from None
    return argv


def _known_keys(parser: argparse.ArgumentParser) -> list[str]:
    """Each settable flag once, by its first long name (not --help, --config, --no-x)."""
    names = {a.option_strings[0][2:] for a in parser._actions  # noqa: SLF001
             if a.option_strings and a.option_strings[0].startswith("--") and a.dest not in ("help", "config")}
    return sorted(names)


def _load_mapping(path: Path) -> dict:
    import yaml

    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigFileError(f"{path}: not valid YAML{line}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigFileError(f"{path}: expected a mapping of flag names to values, got {type(loaded).__name__}")
    return loaded


def _flag_tokens(action: argparse.Action, flag: str, value: object) -> list[str]:
    """The command-line tokens for one key of a config file, after checking the value."""
    if action.nargs == 0:  # store_true / store_false / --x --no-x: a YAML boolean
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value == bool(action.const) else []
    if isinstance(value, (list, dict)) or value is None:
        raise ValueError(f"expected one value, got {value!r}")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    converted = _convert(action, text)
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"invalid choice {text!r} (choose from {', '.join(map(str, action.choices))})")
    return [flag, text]


def _convert(action: argparse.Action, text: str) -> object:
    if action.type is None:
        return text
    try:
        return action.type(text)
    except argparse.ArgumentTypeError:
        raise
    except (ValueError, TypeError):
        name = getattr(action.type, "__name__", repr(action.type))
        raise ValueError(f"invalid {name} value: {text!r}") from None
