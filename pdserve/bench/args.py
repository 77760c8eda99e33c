"""`pdserve bench` flags: `vllm bench serve`'s names and defaults where the meaning is shared.

Differences, on purpose: --temperature defaults to 0 (greedy, comparable across servers);
the result JSON always holds the per-request arrays (--save-detailed is accepted and implied);
`--plot` writes PNG charts; dataset names `prefix` and `sharegpt-like` (vLLM's
`prefix_repetition` and `sharegpt` are accepted as aliases), `jsonl` (alias `custom`).
"""

from __future__ import annotations

import argparse
import json

DATASETS = {"random": "random", "prefix": "prefix", "prefix_repetition": "prefix",
            "sharegpt-like": "sharegpt-like", "sharegpt": "sharegpt-like", "jsonl": "jsonl", "custom": "jsonl"}
"""Accepted --dataset-name -> the dataset it means."""
GOODPUT_NAMES = ("ttft", "tpot", "e2el")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="server URL, e.g. http://127.0.0.1:8000 (unset: http://HOST:PORT of --host, --port)")
    g.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given")
    g.add_argument("--port", type=int, default=8000, help="server port when --base-url is not given")
    g.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"),
                   help="API path the requests go to")
    g.add_argument("--backend", default=None, choices=("openai", "openai-chat", "vllm"),
                   help="recorded in the JSON (default: from --endpoint)")
    g.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    g.add_argument("--served-model-name", default=None, help="name sent in requests when it differs from --model")
    g.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF folder for prompt lengths (default: --model if it is a local path, "
                        "else the default model)")
    g.add_argument("--header", metavar="KEY=VALUE", nargs="*", help="extra HTTP headers")
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=sorted(DATASETS), help="where the prompts come from")
    g.add_argument("--dataset-path", default=None, help="file of the sharegpt-like and jsonl datasets")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    g.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times")
    g.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    g.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    g.add_argument("--random-input-len", type=int, default=1024, help="random dataset: prompt tokens")
    g.add_argument("--random-output-len", type=int, default=128, help="random dataset: output tokens")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L (1 - r), L (1 + r)], 0 <= r < 1")
    g.add_argument("--random-prefix-len", type=int, default=0, help="shared prefix tokens before each random prompt")
    g.add_argument("--prefix-repetition-prefix-len", "--prefix-len", type=int, default=256,
                   help="prefix dataset: tokens of each shared prefix")
    g.add_argument("--prefix-repetition-suffix-len", "--suffix-len", type=int, default=256,
                   help="prefix dataset: tokens after the prefix, different in every prompt")
    g.add_argument("--prefix-repetition-num-prefixes", "--num-prefixes", type=int, default=10,
                   help="prefix dataset: distinct prefixes the prompts share")
    g.add_argument("--prefix-repetition-output-len", type=int, default=128, help="prefix dataset: output tokens")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt-like dataset: output tokens (unset: each conversation's own reply length)")
    g.add_argument("--custom-output-len", "--jsonl-output-len", type=int, default=256,
                   help="jsonl dataset: output tokens")

    g = p.add_argument_group("traffic")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson (or gamma with --burstiness); inf sends all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="<1 burstier, >1 more even; 1 is Poisson")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (unset: no limit)")
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent and not measured before the run")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate max tokens even past EOS (always on for the random dataset, as in vLLM)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request (0: greedy)")
    g.add_argument("--top-p", type=float, default=None, help="top_p of every request (unset: the server's)")
    g.add_argument("--top-k", type=int, default=None, help="top_k of every request (unset: the server's)")

    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="metrics whose percentiles are printed")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles to print")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--save-detailed", action="store_true", help="accepted for vLLM; always on")
    g.add_argument("--result-dir", default=None, help="folder of the result JSON (unset: the current one)")
    g.add_argument("--result-filename", default=None,
                   help="name of the result JSON (unset: LABEL-RATEqps[-concurrencyC]-MODEL-DATE.json)")
    g.add_argument("--label", default=None, help="name of the run in the JSON and its file name (unset: the backend)")
    g.add_argument("--metadata", metavar="KEY=VALUE", nargs="*", help="saved in the JSON")
    g.add_argument("--plot", action="store_true", help="also write PNG charts next to the JSON")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def base_url_from(args: argparse.Namespace) -> str:
    """--base-url, else http://HOST:PORT of --host and --port (127.0.0.1:8000 unless given, as
    `vllm bench serve`), said once so a run against the wrong server is not a silent one."""
    if args.base_url:
        return args.base_url.rstrip("/")
    url = f"http://{args.host}:{args.port}"
    print(f"Base URL: {url} (no --base-url: from --host and --port)", flush=True)
    return url


def parse_key_values(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{what} {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (ms); ValueError names the problem."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = None
        if not sep or ms is None:
            raise ValueError(f"--goodput {item!r}: write KEY:MILLISECONDS, e.g. ttft:500")
        if name not in GOODPUT_NAMES:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {', '.join(GOODPUT_NAMES)}")
        if ms < 0:
            raise ValueError(f"--goodput {item!r}: the limit must be >= 0")
        slos[name] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must lie in [0, 100]; got {text!r}")
    return values
