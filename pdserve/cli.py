"""`pdserve` command line: `generate` and `chat` run the engine in this process; `up` runs a
supervised cluster of local processes; `scale` is the client of the router's roles API."""

from __future__ import annotations

import argparse
import sys

from kv_transfer.base import KV_TRANSFER_BACKENDS
from pdserve.engine_args import ConfigFileError, add_config_arg, add_engine_args, config_file_argv, engine_config_from_args
from pdserve.engine_args import parse_redis_url


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens with this probability (1: all)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens only (0: all)")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler (unset: random)")


def _sampling_params(args: argparse.Namespace):
    from engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.sampling_seed,
    )


def _build_llm(args, parser):
    from engine.capacity import KVCacheTooSmall
    from engine.llm import LLM

    config = engine_config_from_args(args, parser)
    _check_engine(config, parser, f"pdserve {args.command}")
    try:
        return LLM.from_config(config)
    except KVCacheTooSmall as exc:  # a budget of free memory: known only once the model is in
        parser.exit(2, f"pdserve {args.command}: {exc}\n")


def cmd_generate(args, parser) -> int:
    llm = _build_llm(args, parser)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    for out in llm.generate(prompts, _sampling_params(args)):
        print(out.prompt + out.text if args.echo else out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args, parser) -> int:
    llm = _build_llm(args, parser)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in {"/exit", "/quit"}:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        [out] = llm.chat(messages, _sampling_params(args))
        messages.append({"role": "assistant", "content": out.text})
        print(("assistant> " if interactive else "") + out.text, flush=True)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, as `vllm serve --help` shows it; a default of
    None or False (unset, or a switch that is off) is left out, its help text says what unset
    means. Descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with HelpFormatter; add_subparsers makes every command's
    parser one too, so a command added later shows its defaults without being told."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _add_command(sub, name: str, text: str, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A subcommand whose one-line help (in `pdserve --help`) is also its --help description."""
    return sub.add_parser(name, parents=[common], help=text, description=text)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pdserve", description="prefill/decode disaggregated LLM serving")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                        help=f"logging level: {', '.join(LOG_LEVELS)} (any case)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = _add_command(sub, "generate", "complete prompts with the engine in this process", common)
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line of stdin)")
    gen.add_argument("--echo", action="store_true", help="print the prompt before its completion")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = _add_command(sub, "chat", "chat with the model's chat template (stdin lines)", common)
    chat.add_argument("--system", default=None, help="system message (unset: none)")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from pdserve.worker_main import add_worker_args, run_worker

    for role, text in (("prefill", "run a prefill worker (gRPC)"), ("decode", "run a decode worker (gRPC)")):
        worker = _add_command(sub, role, text, common)
        add_worker_args(worker)
        worker.set_defaults(func=lambda args, parser, role=role: run_worker(role, args, parser))

    from pdserve.router_args import add_router_args
    from pdserve.router_main import run_router

    router = _add_command(sub, "router", "run the router (OpenAI HTTP + gRPC)", common)
    add_router_args(router)
    add_config_arg(router)
    router.set_defaults(func=run_router)

    from pdserve.plan import add_plan_args, run_plan

    plan = _add_command(sub, "plan", "KV capacity and a prefill:decode ratio, before running", common)
    add_plan_args(plan)
    plan.set_defaults(func=lambda args, parser, plan=plan: run_plan(args, plan))

    bench = _add_command(sub, "bench", "load-test an OpenAI-compatible server (flags of `vllm bench serve`)", common)
    from pdserve.bench.args import add_bench_args

    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    up = _add_command(sub, "up", "run a whole cluster (local processes, or Ray actors)", common)
    add_up_args(up)
    up.set_defaults(func=cmd_up)

    from pdserve.launchers.ray.args import add_down_args

    down = _add_command(sub, "down", "stop a cluster started by `pdserve up --launcher ray`", common)
    add_down_args(down)
    down.set_defaults(func=cmd_down)

    from pdserve.scale_client import add_scale_args, cmd_scale

    scale = _add_command(sub, "scale", "set a role's replicas through the router (no assignments: show the roles)",
                         common)
    add_scale_args(scale)
    scale.set_defaults(func=cmd_scale)
    return parser


def add_up_args(up: argparse.ArgumentParser) -> None:
    g = up.add_argument_group("cluster")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers")
    g.add_argument("--decode", type=int, default=1, help="decode workers")
    g.add_argument("--colocated", action="store_true",
                   help="no prefill workers: --decode workers prefill and decode (the baseline)")
    g.add_argument("--host", default="127.0.0.1", help="address the router binds (HTTP and gRPC)")
    g.add_argument("--port", type=int, default=8000, help="OpenAI HTTP port")
    g.add_argument("--grpc-port", type=int, default=50051, help="public gRPC port")
    g.add_argument("--redis-url", type=parse_redis_url, default=None, help="use this Redis instead of an embedded one")
    g.add_argument("--cluster", default="default", help="cluster name (Redis key prefix)")
    g.add_argument("--kv-transfer", default="gloo", choices=KV_TRANSFER_BACKENDS.names(),
                   help="KV transfer backend between prefill and decode workers")
    g.add_argument("--api-key", default=None,
                   help="require this bearer token (visible in ps: prefer PDSERVE_API_KEY / PDSERVE_API_KEY_FILE)")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds a worker being removed (scale-down, Ctrl-C) may finish its in-flight "
                        "requests; past it they end with an explicit error")
    g.add_argument("--max-replicas", type=int, default=16,
                   help="most workers per role a scale request may ask for (the router and supervisor both hold to it)")
    from pdserve.launchers.ray.args import add_launcher_args
    from pdserve.router_args import add_routing_args

    add_launcher_args(up)
    add_routing_args(up.add_argument_group("routing and admission"))
    from pdserve.router_args import add_timeline_args

    add_timeline_args(up.add_argument_group("per-request timelines"))
    from pdserve.logs import add_log_args

    add_log_args(up.add_argument_group("logging"))
    add_engine_args(up)


def cmd_bench(args, parser) -> int:
    from pdserve.bench.main import cmd_bench as run_bench  # httpx and numpy only when benching

    return run_bench(args, parser)


def cmd_up(args, parser) -> int:
    from pdserve.launchers.local import busy_port, run_up
    from pdserve.preflight import redis_auth_problem
    from pdserve.specs import RouterSpec, engine_config_from

    for role in ("prefill", "decode"):
        if not 0 <= getattr(args, role) <= args.max_replicas:
            parser.error(f"--{role} must be 0..{args.max_replicas} (--max-replicas); got {getattr(args, role)}")
    if args.drain_timeout < 0:
        parser.error(f"--drain-timeout must be >= 0; got {args.drain_timeout}")
    try:  # every spec `up` will launch, checked before anything starts
        RouterSpec.from_args(args)
        config = engine_config_from(args)
    except ValueError as exc:
        parser.error(str(exc))
    problem = busy_port(args)  # exit 1: the machine's state (or environment), not a flag
    if problem is not None or (args.redis_url and (problem := redis_auth_problem()) is not None):
        print(f"pdserve up: {problem}", file=sys.stderr, flush=True)
        return 1
    _check_key_files()
    if args.launcher == "ray":  # the workers load on the nodes Ray picks (their devices, their model files)
        return run_up(args, ray_cluster_class(parser, args))
    if args.kv_transfer == "nccl":
        parser.exit(2, f"pdserve up: {LOCAL_NCCL}\n")
    _check_engine(config, parser, "pdserve up")
    return run_up(args)


LOCAL_NCCL = (
    "--kv-transfer nccl needs a GPU per worker (NCCL takes one rank per device), and local workers "
    "all start on the same GPU, the first one visible: use --kv-transfer cuda_ipc for workers "
    "sharing a GPU, or --launcher ray / Kubernetes, where each worker has GPUs of its own")
"""Measured on an H100 (benchmarks/gpu_check.py): two workers on one GPU never form an NCCL
channel (ncclInvalidUsage), and every request falls back to the decode worker prefilling it."""


def ray_cluster_class(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """RayCluster, after checking the Ray flags; a missing `ray` is one line naming the extra."""
    from pdserve.launchers.ray.placement import placements_from_args

    try:
        placements_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        from pdserve.launchers.ray.cluster import RayCluster
    except ImportError as exc:
        parser.exit(2, f"pdserve up --launcher ray: Ray is not installed ({exc}); pip install 'pdserve[ray]'\n")
    return RayCluster


def cmd_down(args, parser) -> int:
    try:
        from pdserve.launchers.ray.cluster import run_down
    except ImportError as exc:
        parser.exit(2, f"pdserve down: Ray is not installed ({exc}); pip install 'pdserve[ray]'\n")
    return run_down(args)


def _check_key_files() -> None:
    """The API and admin keys the router will read from $PDSERVE_*_KEY_FILE: an unreadable or
    empty file ends `up` now (one line, exit 1), not the router after the workers loaded."""
    from pdserve.router_main import key_from

    for env in ("PDSERVE_API_KEY", "PDSERVE_ADMIN_KEY"):
        try:
            key_from(None, "", env)
        except SystemExit as exc:
            raise SystemExit(f"pdserve up: {exc}") from None


def _check_engine(config, parser: argparse.ArgumentParser, program: str) -> None:
    """Settings every engine would refuse after loading the model (pdserve.preflight: no such
    model, a KV cache too small for one max_model_len request, ...) end the command here: one
    line, exit 2, nothing started."""
    from pdserve.preflight import check_engine_settings

    try:
        check_engine_settings(config)
    except (ValueError, OSError) as exc:
        parser.exit(2, f"{program}: {exc}\n")


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parser.parse_args, with a --config FILE.yaml expanded into the flags it names, placed
    before the command line's own flags so that those win. A bad file ends the program with one
    line naming the path or key (exit 2)."""
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    command = argv.index(args.command)
    try:
        file_argv = config_file_argv(_command_parser(parser, args.command), args.config)
    except ConfigFileError as exc:
        print(f"pdserve {args.command}: --config {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return parser.parse_args([*argv[:command + 1], *file_argv, *argv[command + 1:]])


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return subparsers.choices[command]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_command_line(parser, argv)
    from pdserve.logs import component_of, configure_logging

    try:
        configure_logging(args.log_level, getattr(args, "log_format", "text"), *component_of(args))
    except ValueError as exc:  # an unknown --log-level
        parser.error(str(exc))
    return args.func(args, parser)
