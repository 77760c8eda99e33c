"""TEST DOUBLES of OpenAI-compatible HTTP prefill and decode servers that answer at once — the
workers the Rust routers (sglang-router, vllm-router) expect, for benchmarks/router_overhead.py
only, never for serving.

They are the HTTP twins of benchmarks/instant_workers.py (same tokens, nothing computed, no KV):

  decode role: POST /v1/completions (and /v1/chat/completions, /generate) answers max_tokens
      tokens at once — streamed as one SSE chunk per token plus a usage chunk and [DONE] when
      `stream` is true, else one JSON body. The decode side of a P/D pair produces the whole
      answer in both Rust routers' P/D modes (sglang: the router sends the request to both and
      relays decode's; vLLM: prefill runs with max_tokens 1, then decode runs the request).
  prefill role: the same routes answer ONE token (what a prefill server returns), with
      vLLM's `kv_transfer_params` in the body so vllm-router hands them on to decode.
  GET /health, /v1/models, /get_server_info, /get_model_info, ...: small constant answers.

The server is a few lines of asyncio over HTTP/1.1 with keep-alive (chunked for streams): a
framework would spend more CPU per request than the routers being measured, on the same cores.

Run as a process (what router_overhead.py does):
    python benchmarks/instant_http_workers.py --ready-file F
It writes "PREFILL_URL DECODE_URL" to F once both listen, and runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import time
from pathlib import Path

MODEL = "instant-double"
TOKEN_TEXT = " the"  # token 260 of SmolLM2's vocabulary, what the gRPC doubles send
TOKEN_ID = 260
_ids = itertools.count(1)


def completion_tokens(body: dict, role: str) -> int:
    """Tokens this role answers for one request (prefill: one; decode: max_tokens)."""
    if role == "prefill":
        return 1
    return int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)


def _chunk(rid: str, created: int, chat: bool, text: str | None, finish: str | None, usage=None) -> bytes:
    if chat:
        choice = {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": MODEL,
            "choices": [] if usage else [choice]}
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def stream_events(body: dict, role: str, chat: bool) -> list[bytes]:
    """The SSE events of one streamed answer (pure; tested)."""
    count, rid, created = completion_tokens(body, role), f"cmpl-{next(_ids)}", int(time.time())
    events = [_chunk(rid, created, chat, TOKEN_TEXT, "length" if i == count - 1 else None) for i in range(count)]
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": _prompt_len(body), "completion_tokens": count,
                 "total_tokens": _prompt_len(body) + count}
        events.append(_chunk(rid, created, chat, None, None, usage))
    events.append(b"data: [DONE]\n\n")
    return events


def _prompt_len(body: dict) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt or body.get("messages", "")).split())


def full_body(body: dict, role: str, chat: bool) -> dict:
    """The JSON of one non-streamed answer."""
    count = completion_tokens(body, role)
    text = TOKEN_TEXT * count
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
              if chat else {"index": 0, "text": text, "finish_reason": "length"})
    answer = {"id": f"cmpl-{next(_ids)}", "object": "chat.completion" if chat else "text_completion",
              "created": int(time.time()), "model": MODEL, "choices": [choice],
              "usage": {"prompt_tokens": _prompt_len(body), "completion_tokens": count,
                        "total_tokens": _prompt_len(body) + count}}
    if role == "prefill":  # vllm-router hands these to the decode request
        answer["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": "instant",
                                        "remote_block_ids": [], "remote_host": "127.0.0.1", "remote_port": 0}
    return answer


INFO = {"/v1/models": {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "pdserve"}]},
        "/get_model_info": {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True},
        "/model_info": {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True},
        "/get_server_info": {"model_path": MODEL, "disaggregation_mode": "null", "disaggregation_bootstrap_port": 0},
        "/server_info": {"model_path": MODEL, "disaggregation_mode": "null", "disaggregation_bootstrap_port": 0}}


class Http11:
    """One connection: requests in order, keep-alive; answers written as soon as parsed."""

    def __init__(self, role: str, unknown: set[str]) -> None:
        self.role, self.unknown = role, unknown

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"PRI * HTTP/2"):  # sglang-router probes for HTTP/2 (gRPC workers)
                    return
                method, path, headers = _parse_head(head)
                length = int(headers.get("content-length", "0"))
                raw = await reader.readexactly(length) if length else b""
                self.answer(writer, method, path.split("?", 1)[0], raw)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    def answer(self, writer: asyncio.StreamWriter, method: str, path: str, raw: bytes) -> None:
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            body, chat = json.loads(raw or b"{}"), path == "/v1/chat/completions"
            if body.get("stream"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for event in stream_events(body, self.role, chat):
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                writer.write(b"0\r\n\r\n")
                return
            return _write_json(writer, full_body(body, self.role, chat))
        if path in INFO:
            return _write_json(writer, INFO[path])
        if path not in self.unknown and not path.startswith("/health"):
            self.unknown.add(path)
            print(f"instant http double ({self.role}): {method} {path} answered 200 {{}}", file=sys.stderr, flush=True)
        _write_json(writer, {})


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return method, path, headers


def _write_json(writer: asyncio.StreamWriter, body: object) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(data), data))


async def serve(args: argparse.Namespace) -> None:
    unknown: set[str] = set()
    prefill = await asyncio.start_server(Http11("prefill", unknown).serve, "127.0.0.1", 0)
    decode = await asyncio.start_server(Http11("decode", unknown).serve, "127.0.0.1", 0)
    urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in (prefill, decode)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.ready_file:
        Path(args.ready_file).write_text(" ".join(urls) + "\n")
    try:
        await stop.wait()
    finally:
        for server in (prefill, decode):
            server.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ready-file", default=None, help="write 'PREFILL_URL DECODE_URL' here once listening")
    args = p.parse_args(argv)
    try:
        import uvloop  # the same event loop the router gets
        uvloop.run(serve(args))
    except ImportError:
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
