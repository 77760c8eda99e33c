"""Loading a tokenizer from a Hugging Face model folder.

Files read (only `tokenizer.json` is required):
- tokenizer.json: vocabulary, normalizer, pre-tokenizer, post-processor, decoder, added tokens.
- tokenizer_config.json: bos/eos token strings, `add_bos_token` / `add_eos_token`, and in older
  models the chat template (a string, or a list of {"name", "template"} where "default" is used).
- chat_template.jinja: the chat template in newer models; it wins over tokenizer_config.json.
- generation_config.json: `eos_token_id` (an int or a list), all of which stop generation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from engine.tokenizer.gguf_vocab import bos_eos_processor
from engine.tokenizer.meta import TokenizerMeta, stop_ids, template_tokens


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a token either as its text or as a serialized AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template if isinstance(template, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def load_hf_dir(folder: str | Path) -> tuple[BackendTokenizer, TokenizerMeta]:
    """The backend tokenizer and its meta for an HF model folder.

    When tokenizer_config.json states `add_bos_token` or `add_eos_token`, the post-processor is
    rebuilt from those flags (as transformers does for Llama-style tokenizers); otherwise the one
    in tokenizer.json is kept. Raises FileNotFoundError when tokenizer.json is missing.
    """
    folder = Path(folder)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{folder}: no tokenizer.json in this model folder")
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    config = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")

    def lookup(name: str) -> int | None:
        text = _token_text(config.get(name))
        return None if text is None else backend.token_to_id(text)

    bos_id, eos_id = lookup("bos_token"), lookup("eos_token")
    if eos_id is None and _as_ids(generation.get("eos_token_id")):
        eos_id = _as_ids(generation.get("eos_token_id"))[0]
    if "add_bos_token" in config or "add_eos_token" in config:
        backend.post_processor = bos_eos_processor(
            backend,
            bos_id if config.get("add_bos_token") else None,
            eos_id if config.get("add_eos_token") else None,
        )
    meta = TokenizerMeta(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        stop_token_ids=stop_ids(backend, [eos_id, *_as_ids(generation.get("eos_token_id"))]),
        chat_template=_chat_template(folder, config),
        template_tokens=template_tokens(
            backend,
            bos_token=bos_id,
            eos_token=eos_id,
            unk_token=lookup("unk_token"),
            pad_token=lookup("pad_token"),
        ),
    )
    return backend, meta
