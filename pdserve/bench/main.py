"""`pdserve bench`: build the prompts, run them against the server, print and save the results.

Exit status: 0 when at least one request completed (failures are reported, not fatal),
1 when none did, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import aiohttp

from pdserve.bench.args import DATASETS, base_url_from, parse_goodput, parse_key_values, parse_percentiles
from pdserve.bench.client import Endpoint, open_session
from pdserve.bench.datasets import SampleRequest, prefix_requests, random_requests
from pdserve.bench.datasets_files import jsonl_requests, sharegpt_requests
from pdserve.bench.metrics import METRICS, compute_metrics
from pdserve.bench.report import RunInfo, failure_lines, result_block, result_json, result_path, save_json
from pdserve.bench.runner import RunSettings, run_benchmark


def tokenizer_source(args: argparse.Namespace) -> Path:
    """--tokenizer, else --model when it names a local file or folder, else the default model."""
    from engine.loader.locate import default_model_path

    if args.tokenizer:
        return Path(args.tokenizer).expanduser()
    if args.model and Path(args.model).expanduser().exists():
        return Path(args.model).expanduser()
    return default_model_path()


def load_requests(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    dataset, n, seed = DATASETS[args.dataset_name], args.num_prompts, args.seed
    if dataset == "random":
        return random_requests(tokenizer, n, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.random_prefix_len, seed)
    if dataset == "prefix":
        return prefix_requests(tokenizer, n, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                               args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, seed)
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if dataset == "sharegpt-like":
        return sharegpt_requests(tokenizer, args.dataset_path, n, args.sharegpt_output_len, seed)
    return jsonl_requests(tokenizer, args.dataset_path, n, args.custom_output_len)


def apply_general_lengths(args: argparse.Namespace) -> None:
    """--input-len / --output-len set the dataset-specific lengths (as in vLLM)."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.prefix_repetition_output_len = args.output_len
        args.sharegpt_output_len = args.custom_output_len = args.output_len


async def first_model(base_url: str, headers: dict[str, str]) -> str:
    async with open_session(timeout_s=30) as session, session.get(f"{base_url}/v1/models", headers=headers) as response:
        response.raise_for_status()
        models = (await response.json(content_type=None)).get("data") or []
    if not models:
        raise RuntimeError(f"the server at {base_url} lists no model")
    return models[0]["id"]


TOKEN_TIMES = {"X-Pdserve-Token-Times": "1"}
"""Asks a pdserve router for each token's sample time (token delivery delay); others ignore it."""


def build_endpoint(args: argparse.Namespace, base_url: str, model: str, headers: dict[str, str]) -> Endpoint:
    sampling = {"top_p": args.top_p, "top_k": args.top_k}
    extra = {k: v for k, v in sampling.items() if v is not None} | (args.extra_body or {})
    # vLLM's rule: the random dataset always runs to its planned lengths.
    ignore_eos = args.ignore_eos or DATASETS[args.dataset_name] == "random"
    return Endpoint(api_url=base_url + args.endpoint, model=args.served_model_name or model,
                    chat=args.endpoint.endswith("chat/completions"), ignore_eos=ignore_eos,
                    temperature=args.temperature, extra_body=extra,
                    headers=TOKEN_TIMES | headers)


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    import os

    headers = {}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    return headers | parse_key_values(args.header, "--header")


async def bench(args: argparse.Namespace) -> int:
    from engine.tokenizer import load_tokenizer  # no torch: the tokenizer reads GGUF metadata

    apply_general_lengths(args)
    goodput = parse_goodput(args.goodput)
    percentiles = parse_percentiles(args.metric_percentiles)
    printed = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := set(printed) - set(METRICS):
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; use {', '.join(METRICS)}")
    base_url = base_url_from(args)
    headers = auth_headers(args)
    model = args.model or await first_model(base_url, headers)
    source = tokenizer_source(args)
    requests = load_requests(args, load_tokenizer(source))
    endpoint = build_endpoint(args, base_url, model, headers)
    settings = RunSettings(endpoint, args.request_rate, args.burstiness, args.max_concurrency, args.seed,
                           args.num_warmups, progress=not args.disable_tqdm)
    backend = args.backend or ("openai-chat" if endpoint.chat else "openai")
    info = RunInfo(backend, model, str(source), len(requests), args.request_rate, args.burstiness,
                   args.max_concurrency, args.label)
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({'Poisson process' if args.burstiness == 1 else 'Gamma distribution'})")
    print(f"Maximum request concurrency: {args.max_concurrency}", flush=True)
    run = await run_benchmark(settings, requests)
    metrics = compute_metrics(run.outputs, run.duration_s, percentiles, goodput)
    for line in failure_lines(run):
        print(line)
    print(result_block(metrics, run, info, printed, percentiles, bool(goodput)), flush=True)
    finish(args, run, metrics, info, bool(goodput))
    return 0 if metrics.completed else 1


def finish(args, run, metrics, info: RunInfo, goodput: bool) -> None:
    """Save the JSON (--save-result) and the charts (--plot)."""
    result = result_json(metrics, run, info, goodput)
    result.update(parse_key_values(args.metadata, "--metadata"))
    path = result_path(info, args.result_dir, args.result_filename, result["date"])
    if args.save_result:
        print(f"result saved to {save_json(result, path)}")
    if args.plot:
        from pdserve.bench.plot import write_plots

        for chart in write_plots(run.outputs, metrics, path.with_suffix("")):
            print(f"chart saved to {chart}")


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if not args.request_rate > 0 or not args.burstiness > 0:
        parser.error("--request-rate and --burstiness must be > 0")
    try:
        return asyncio.run(bench(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
        print(f"pdserve bench: cannot reach the server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("pdserve bench: interrupted", file=sys.stderr)
        return 130


