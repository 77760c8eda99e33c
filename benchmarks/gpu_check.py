"""The GPU path on one CUDA device, in one run: the kernels against their references and the
device's copy bandwidth, the engine's greedy tokens with the kernels against its torch path,
`pdserve up` with cuda_ipc (and nccl) serving the same tokens, and decode throughput against
HF transformers on the same weights.

    # on any machine with the default model installed: the 30 prompts and the tokenizer
    .venv/bin/python benchmarks/gpu_check.py prepare --out .gpu
    # on the GPU machine (a SmolLM2-135M-shaped model with random weights is written there)
    python3 benchmarks/gpu_check.py run --inputs .gpu --out DIR [--stages kernels,engine,...]

Stages (each one's result lands in DIR/gpu_check.json as soon as it is known; a failing stage
is recorded and the next one runs):

- kernels: pytest tests/gpu plus the CPU-side kernel checks (compile, references), output kept.
- engine: the engine in-process on cuda, 30 prompts (the exactness tests' prompts) x 48 greedy
  tokens (ignore_eos) in one batch: kernels on against the torch path (engine.model.attention
  with the kernels off), float32 (identical?) and bfloat16 (first divergence per prompt).
- engine also runs HF transformers generate on the same weights in float32 (the independent
  reference) and compares the bfloat16 torch path with the float32 one (bfloat16's own
  divergence, the yardstick for the kernels').
- cluster-<backend> (cuda_ipc, gloo; nccl by name only: `pdserve up` refuses it, its local
  workers share one GPU): `pdserve up --prefill 1 --decode 1 --device cuda --dtype float32
  --kv-transfer <backend>`, the 30 prompts at once over HTTP; tokens against the engine's
  (run engine first), the path each took, and both KV pools empty afterwards.
- cluster-memory: the same with cuda_ipc but no block count, so the launcher splits its default
  share of the GPU (0.9 of the whole) between the two workers: their pools, the GPU memory held,
  the same tokens; and, while they hold it, an engine asking for half the GPU must be refused at
  start with the numbers.
- ipc-bandwidth: cuda_ipc between this process and a sender process (payloads of 64 MiB to
  1 GiB) against the device's own copy.
- throughput: decode tokens/s at batch 1, 32 and 128 (32-token prompts, 128 new tokens),
  pdserve's engine against HF transformers generate, same weights, bfloat16, one after the other.

The model: SmolLM2-135M-Instruct's shape (30 layers, 576 wide, 9 heads over 3 KV heads, tied
embeddings) with seeded random weights, written where it runs (no 98 MB GGUF to copy). Its
tokens are noise, but they are the same noise on every path, which is what is compared; in
bfloat16 its flat logits make near-ties common. `--model PATH` checks a GGUF file or HF folder
instead, e.g. the real default GGUF where it can be copied to the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NEW_TOKENS = 48

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


# -- prepare (any machine with the default model) ----------------------------------------------

def prepare(out: Path) -> None:
    """The exactness tests' 30 prompts as token ids, and the default model's tokenizer as an HF
    folder (tokenizer.json and its config), small enough to travel."""
    from tests.real_model import hf_tokenizer, prompt_token_ids

    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.json").write_text(json.dumps([list(p) for p in prompt_token_ids()]))
    hf_tokenizer().save_pretrained(out / "tokenizer")
    print(f"wrote {out / 'prompts.json'} and {out / 'tokenizer'}")


# -- the model -----------------------------------------------------------------------------------

def write_model(folder: Path, tokenizer: Path, seed: int = 0) -> Path:
    """SmolLM2-135M's shape with seeded random weights (std 0.05: the output depends on the
    context), in float32, the tokenizer files beside it."""
    import shutil

    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    c = SMOLLM2_135M
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    state = {"model.embed_tokens.weight": rand(c["vocab_size"], h), "model.norm.weight": torch.ones(h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for name, rows, cols in (("self_attn.q_proj", q, h), ("self_attn.k_proj", kv, h),
                                 ("self_attn.v_proj", kv, h), ("self_attn.o_proj", h, q),
                                 ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h), ("mlp.down_proj", h, i)):
            state[p + name + ".weight"] = rand(rows, cols)
        state[p + "input_layernorm.weight"] = torch.ones(h)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(c))
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    return folder


# -- stages --------------------------------------------------------------------------------------

def hf_model(model: Path, dtype):
    """HF transformers' model of the same weights: an HF folder, or a GGUF file (transformers
    dequantizes it itself)."""
    from transformers import AutoModelForCausalLM

    if model.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)


def stage_kernels(args, results: dict) -> None:
    log = args.out / "kernels.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--timeout=150", "tests/gpu",
           "tests/unit/test_kernels_compile.py", "tests/unit/test_kernel_references.py"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.stage_timeout)
    log.write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    speeds = [line for line in tail if "GB/s" in line]
    results["kernels"] = {"rc": proc.returncode, "summary": tail[-1] if tail else "", "speeds": speeds}


def _engine_tokens(model: Path, prompts, dtype: str, kernels: bool, blocks: int,
                   device: str) -> list[list[int]]:
    import torch

    import engine.model.attention as attention
    from engine import LLM, SamplingParams

    saved = attention._use_kernels
    if not kernels:
        attention._use_kernels = lambda x, kv_cache: False
    try:
        llm = LLM(model=str(model), dtype=dtype, device=device, num_gpu_blocks_override=blocks,
                  max_model_len=1024)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate([list(p) for p in prompts], params)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
        return tokens
    finally:
        attention._use_kernels = saved


def _first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token; len when equal."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def stage_engine(args, results: dict) -> None:
    out = {}
    for dtype in args.engine_dtypes:
        with_kernels = _engine_tokens(args.model, args.prompts, dtype, True, args.blocks, args.device)
        torch_path = _engine_tokens(args.model, args.prompts, dtype, False, args.blocks, args.device)
        div = [_first_divergence(a, b) for a, b in zip(with_kernels, torch_path)]
        out[dtype] = {"identical": sum(a == b for a, b in zip(with_kernels, torch_path)),
                      "prompts": len(div), "first_divergence": div,
                      "diverge_at_32_or_later": sum(d >= 32 for d in div)}
        args.tokens[dtype] = {"kernels": with_kernels, "torch": torch_path}
    if {"float32", "bfloat16"} <= set(args.tokens):
        # bfloat16's own rounding, as a yardstick for the kernels' divergence: its torch path
        # against float32's
        div = [_first_divergence(a, b) for a, b in zip(args.tokens["bfloat16"]["torch"], args.tokens["float32"]["torch"])]
        out["bfloat16_torch_vs_float32"] = {"identical": sum(d == NEW_TOKENS for d in div), "first_divergence": div,
                                            "diverge_at_32_or_later": sum(d >= 32 for d in div)}
    (args.out / "engine_tokens.json").write_text(json.dumps(args.tokens))
    hf = _hf_tokens(args)
    div = [_first_divergence(a, b) for a, b in zip(args.tokens["float32"]["kernels"], hf)]
    out["float32_vs_hf"] = {"identical": sum(d == NEW_TOKENS for d in div), "prompts": len(div),
                            "first_divergence": div}
    results["engine"] = out


def _hf_tokens(args) -> list[list[int]]:
    """HF transformers' greedy generate on the same weights, float32, one prompt at a time."""
    import torch

    hf = hf_model(args.model, torch.float32).to(args.device).eval()
    tokens = []
    with torch.inference_mode():
        for ids in args.prompts:
            seq = hf.generate(torch.tensor([ids], device=args.device), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            tokens.append(seq[0, len(ids):].tolist())
    del hf
    return tokens


def stage_cluster(backend: str, args, results: dict, name: str | None = None, sized: bool = True,
                  while_up=None) -> None:
    """`pdserve up` with one prefill and one decode worker on the device. sized: each KV cache
    is --num-gpu-blocks-override blocks; else the launcher's default share of the GPU, split
    between the two workers. while_up(cluster, res) runs before the cluster stops."""
    import asyncio

    import httpx

    from tests.e2e.cluster import start_cluster

    name = name or f"cluster-{backend}"
    want = args.tokens.get("float32", {}).get("kernels")
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--model", str(args.model), "--device", args.device, "--dtype", "float32",
                 "--served-model-name", "smollm2-random",
                 "--kv-transfer", backend, "--prefill", "1", "--decode", "1", "--max-model-len", "1024"]
        if sized:
            flags += ["--num-gpu-blocks-override", str(args.blocks)]
        started = time.monotonic()
        try:
            cluster = start_cluster(Path(tmp), *flags, timeout_s=150)
        except RuntimeError as exc:
            (args.out / f"{name}.log").write_text(str(exc))
            raise
        up_s = time.monotonic() - started
        try:
            async def one(client, ids):
                r = await client.post("/v1/completions", json={
                    "model": "smollm2-random", "prompt": list(ids), "max_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                return r

            async def all_at_once():
                async with httpx.AsyncClient(base_url=cluster.base_url, timeout=180) as client:
                    return await asyncio.gather(*(one(client, ids) for ids in args.prompts))

            t0 = time.monotonic()
            replies = asyncio.run(all_at_once())
            wall = time.monotonic() - t0
            bad = [r.text[:300] for r in replies if r.status_code != 200]
            got = [r.json()["choices"][0]["token_ids"] for r in replies if r.status_code == 200]
            paths = sorted({r.headers.get("x-pdserve-path", "?") for r in replies})
            pools = cluster.wait_for_empty_pools(timeout_s=20)
            res = {"up_s": round(up_s, 1), "wall_s": round(wall, 2), "errors": bad, "paths": paths,
                   "pools_after": {k: list(v) for k, v in pools.items()}}
            if want is not None and not bad:
                div = [_first_divergence(a, b) for a, b in zip(got, want)]
                res.update(identical_to_engine=sum(a == b for a, b in zip(got, want)),
                           prompts=len(div), first_divergence=div)
            results[name] = res
            if while_up is not None:
                while_up(cluster, res)
        finally:
            cluster.stop()
            (args.out / f"{name}.log").write_text(cluster.log.read_text()[-20000:])


def stage_cluster_memory(args, results: dict) -> None:
    """The launcher's GPU memory split: `pdserve up` without a block count, so each of its two
    workers on the one GPU takes its share of the default 0.9 (a share of the whole GPU, as in
    vLLM). Then, with those two holding their memory, an engine asking for half the GPU must be
    refused at start with the numbers, not fail while allocating its cache."""
    import re

    import torch

    from engine import LLM

    def while_up(cluster, res):
        res["capacity_lines"] = [line for line in cluster.log.read_text().splitlines()
                                 if re.search(r"blocks x \d+ = ", line)][:4]
        if args.device != "cuda":  # a dry run of the stage itself: no GPU memory to read or split
            return
        free, total = torch.cuda.mem_get_info()
        res["gpu_used_while_up_gib"] = round((total - free) / 2**30, 1)
        res["gpu_total_gib"] = round(total / 2**30, 1)
        try:
            LLM(model=str(args.model), dtype="float32", device=args.device, max_model_len=1024,
                gpu_memory_utilization=0.5)
            res["half_gpu_engine"] = "started (expected a refusal)"
        except Exception as exc:  # the refusal is the expected outcome; record its words
            res["half_gpu_engine"] = f"{type(exc).__name__}: {exc}"[:600]
        torch.cuda.empty_cache()

    backend = "cuda_ipc" if args.device == "cuda" else "gloo"  # gloo: the dry run on a CPU
    stage_cluster(backend, args, results, name="cluster-memory", sized=False, while_up=while_up)
    res = results["cluster-memory"]
    res["pool_blocks"] = {wid: total for wid, (total, _free, _res) in res["pools_after"].items()}


def stage_throughput(args, results: dict) -> None:
    import torch

    from engine import LLM, SamplingParams

    new, plen = 128, 32

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    g = torch.Generator().manual_seed(1)
    batches = tuple(args.batches)
    prompts = torch.randint(100, 40000, (max(batches), plen), generator=g).tolist()
    out = {}
    llm = LLM(model=str(args.model), dtype="bfloat16", device=args.device, num_gpu_blocks_override=args.blocks,
              max_model_len=1024, max_num_seqs=max(batches))
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:4], params)  # warm-up
    for b in batches:
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:b], params)
        sync()
        s = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        out[f"pdserve_b{b}"] = round(b * new / s, 1)
    del llm
    if args.device == "cuda":
        torch.cuda.empty_cache()

    hf = hf_model(args.model, torch.bfloat16).to(args.device).eval()
    with torch.inference_mode():
        hf.generate(torch.tensor(prompts[:4], device=args.device), max_new_tokens=8, do_sample=False,
                    pad_token_id=0)
        for b in batches:
            ids = torch.tensor(prompts[:b], device=args.device)
            sync()
            t0 = time.perf_counter()
            seq = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            sync()
            s = time.perf_counter() - t0
            assert seq.shape[1] == plen + new
            out[f"hf_b{b}"] = round(b * new / s, 1)
    for b in batches:
        out[f"ratio_b{b}"] = round(out[f"pdserve_b{b}"] / out[f"hf_b{b}"], 2)
    out["method"] = (f"{plen}-token random prompts, {new} new tokens each (ignore_eos, greedy), "
                     "tokens/s = batch x new / wall time of the whole generate (prefill included), "
                     "bfloat16, after a warm-up; pdserve engine first, then HF transformers generate")
    results["throughput"] = out


IPC_BLOCKS = (32, 128, 512)
"""Payloads of [32 layers, 2, blocks, 16 tokens, 8 KV heads, 128] bfloat16: 2 MiB a block."""


def ipc_send(host: str, port: str, channel_id: str, repeat: str) -> int:
    """The sender (P) of stage ipc-bandwidth, in its own process: each size `repeat` times,
    one at a time; prints [[nbytes, seconds], ...] (the TransferResult's own timing)."""
    import torch

    from kv_transfer.base import ChannelAddress, TransferConfig, TransferState
    from kv_transfer.cuda_ipc import CudaIpcBackend
    from kv_transfer.packing import make_header

    sender = CudaIpcBackend(TransferConfig(device="cuda:0", timeout_s=60.0)).connect(
        ChannelAddress(host, int(port), channel_id))
    timings, ticket = [], 0
    for blocks in IPC_BLOCKS:
        payload = torch.randn(32, 2, blocks, 16, 8, 128, device="cuda:0").to(torch.bfloat16)
        for _ in range(int(repeat) + 1):  # the first of each size warms up
            ticket += 1
            torch.cuda.synchronize()
            sender.send(make_header(ticket, 7, payload), payload)
            deadline, done = time.monotonic() + 60, []
            while not done and time.monotonic() < deadline:
                done = sender.poll()
                time.sleep(0.0005)
            if not done or done[0].state is not TransferState.DONE:
                print(json.dumps({"error": str(done[0].error if done else "timeout")}))
                return 1
            timings.append([done[0].nbytes, done[0].seconds])
    sender.close()
    print(json.dumps(timings))
    return 0


def stage_ipc_bandwidth(args, results: dict) -> None:
    """cuda_ipc between two processes on the device against its own device-to-device copy."""
    import statistics

    import torch

    from kv_transfer.base import TransferConfig
    from kv_transfer.cuda_ipc import CudaIpcBackend

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    copy_gbps = src.numel() * 10 / (time.perf_counter() - t0) / 1e9  # bytes copied (not read + written)
    del src, dst
    receiver = CudaIpcBackend(TransferConfig(device="cuda:0", timeout_s=60.0)).open_receiver()
    address = receiver.open_channel()
    repeat = 3
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "ipc-send", address.host,
                             str(address.port), address.channel_id, str(repeat)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            receiver.poll()  # received payloads are dropped at once
            time.sleep(0.001)
        stdout, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()
        receiver.close()
    timings = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {"error": stderr[-2000:]}
    if isinstance(timings, dict):
        raise RuntimeError(f"ipc sender: {timings}")
    out = {"copy_GBps": round(copy_gbps, 1)}
    per = repeat + 1
    for k, blocks in enumerate(IPC_BLOCKS):
        runs = timings[k * per + 1:(k + 1) * per]
        gbps = statistics.median(n / s / 1e9 for n, s in runs)
        out[f"{blocks * 2}MiB_GBps"] = round(gbps, 1)
        out[f"{blocks * 2}MiB_share_of_copy"] = round(gbps / copy_gbps, 2)
    out["method"] = ("payload bytes / the sender's TransferResult.seconds (header, pieces through "
                     "D's 64 MiB staging buffer, D's copy out, ack), median of 3 after a warm-up, "
                     "against one device-to-device copy's bytes per second (torch copy_, 1 GiB)")
    results["ipc-bandwidth"] = out


# -- main ----------------------------------------------------------------------------------------

def run(args) -> int:
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    args.prompts = json.loads((args.inputs / "prompts.json").read_text())[: args.num_prompts]
    args.tokens = {}
    on_gpu = args.device == "cuda"
    results: dict = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "torch": torch.__version__,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import cupy

        results["cupy"] = cupy.__version__
    except ImportError as exc:
        results["cupy"] = f"missing: {exc}"
    sink = args.out / "gpu_check.json"

    def save():
        sink.write_text(json.dumps(results, indent=1))

    stages = {"kernels": stage_kernels, "engine": stage_engine, "throughput": stage_throughput,
              "cluster-cuda_ipc": lambda a, r: stage_cluster("cuda_ipc", a, r),
              "cluster-nccl": lambda a, r: stage_cluster("nccl", a, r),
              "cluster-gloo": lambda a, r: stage_cluster("gloo", a, r),
              "cluster-memory": stage_cluster_memory,
              "ipc-bandwidth": stage_ipc_bandwidth}
    unknown = sorted(set(args.stages.split(",")) - set(stages))
    if unknown:
        raise SystemExit(f"unknown stage(s) {unknown}; known: {', '.join(stages)}")
    with tempfile.TemporaryDirectory(prefix="smollm2-shaped-") as tmp:  # 540 MB of weights
        args.model = args.model or write_model(Path(tmp) / "smollm2-random", args.inputs / "tokenizer")
        for name in args.stages.split(","):
            t0 = time.monotonic()
            print(f"== {name}", flush=True)
            try:
                stages[name](args, results)
            except Exception as exc:  # record and go on: one failing stage must not hide the others
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000],
                                 "traceback": traceback.format_exc()[-4000:]}
            results.setdefault("stage_s", {})[name] = round(time.monotonic() - t0, 1)
            print(json.dumps({name: results.get(name)})[:3000], flush=True)
            save()
    failed = [name for name in args.stages.split(",") if "error" in results.get(name, {})]
    return 1 if failed else 0


def main() -> int:
    from benchmarks.peers.servers import exit_on_sigterm

    exit_on_sigterm()  # the `with` and `finally` blocks stop the clusters and remove the weights
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, default=ROOT / ".gpu")
    r = sub.add_parser("run")
    r.add_argument("--inputs", type=Path, default=ROOT / ".gpu")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--stages", default="kernels,engine,cluster-cuda_ipc,cluster-memory,cluster-gloo,ipc-bandwidth,"
                                      "throughput")
    r.add_argument("--blocks", type=int, default=4096, help="KV blocks per engine")
    r.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    r.add_argument("--model", type=Path, default=None,
                   help="a GGUF file or HF folder to check instead of the random SmolLM2-shaped one "
                        "(e.g. the real default GGUF, where it can be copied to the GPU machine)")
    r.add_argument("--num-prompts", type=int, default=30)
    r.add_argument("--engine-dtypes", type=lambda v: v.split(","), default=["float32", "bfloat16"])
    r.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 32, 128])
    r.add_argument("--stage-timeout", type=float, default=300)
    s = sub.add_parser("ipc-send")
    for name in ("host", "port", "channel_id", "repeat"):
        s.add_argument(name)
    args = parser.parse_args()
    if args.command == "ipc-send":
        return ipc_send(args.host, args.port, args.channel_id, args.repeat)
    if args.command == "prepare":
        prepare(args.out)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
