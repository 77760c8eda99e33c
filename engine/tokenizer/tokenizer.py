"""The Tokenizer the router and workers use: text <-> token ids, and chat prompts.

Built from a GGUF file (vocabulary in its metadata, tokenized as llama.cpp does) or from a
Hugging Face folder (tokenizer.json). Either way it wraps a `tokenizers.Tokenizer`, so encoding
runs in Rust. Special token text written in the input (e.g. "<|im_start|>") encodes to the
special id, like llama.cpp with `parse_special=True` and like HF.

A Tokenizer is immutable after construction and safe to share between threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from engine.tokenizer.fast_words import FastWordEncoder
from engine.tokenizer.chat_template import render_chat_template
from engine.tokenizer.gguf_vocab import load_gguf
from engine.tokenizer.hf_dir import load_hf_dir
from engine.tokenizer.meta import TokenizerMeta, special_ids


try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers < 0.21
    _DecodeStream = None


class StreamDecoder:
    """One request's incremental decode in the backend (see Tokenizer.stream_decoder).

    `step(id)` appends one id and returns the text it completes, or None while the window's
    text is no longer than what was emitted or ends in U+FFFD: the rule IncrementalDetokenizer
    applies, with the same offsets. Raises when the window's text no longer starts with the
    emitted text (a decoder that rewrote it); its caller then decodes that step itself."""

    __slots__ = ("_stream", "_backend")

    def __init__(self, stream: Any, backend: BackendTokenizer) -> None:
        self._stream, self._backend = stream, backend

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._backend, token_id)


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model."""

    def __init__(self, backend: BackendTokenizer, meta: TokenizerMeta) -> None:
        """Wrap `backend`; the Tokenizer owns it from now on (callers must not modify it)."""
        self._backend = backend
        self._meta = meta
        self._special_ids = special_ids(backend)
        # encode_batch_fast: tokenizers >= 0.21; older ones have only encode_batch.
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        # Short text skips the backend's Oniguruma splits (see fast_words); same ids.
        self._words = FastWordEncoder.for_backend(backend)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """From the tokenizer metadata of a GGUF file (byte-level BPE only).

        Raises ValueError for an unsupported vocabulary type or pre-tokenizer.
        """
        return cls(*load_gguf(path))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a folder holding tokenizer.json (see hf_dir for the other files read).

        Raises FileNotFoundError when tokenizer.json is missing.
        """
        return cls(*load_hf_dir(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. `add_special_tokens` adds BOS (and EOS) only where the model's
        metadata asks for it; special tokens written in `text` are always recognised.
        """
        # A batch call, not encode: the `tokenizers` binding releases the GIL only in the batch
        # calls, so a large prompt tokenized in a worker thread does not stall the event loop
        # (measured: a 1.9 MB prompt held the router's loop for 5 s with encode, 0.2 s with this).
        # The _fast one skips character offsets, which nothing here reads: ~30 instead of ~42 us
        # for a 32-token prompt, on every request's path in the router.
        if self._words is not None:
            ids = self._words.encode(text, add_special_tokens)
            if ids is not None:
                return ids
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of each text: short ones on the fast path, the rest in one backend call
        (its tables are read into the CPU's caches once for all of them)."""
        texts = list(texts)
        found = [None] * len(texts) if self._words is None else [
            self._words.encode(text, add_special_tokens) for text in texts
        ]
        rest = [text for text, ids in zip(texts, found, strict=True) if ids is None]
        if rest:
            encoded = iter(self._encode_batch(rest, add_special_tokens=add_special_tokens))
            found = [next(encoded).ids if ids is None else ids for ids in found]
        return found

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form complete UTF-8 characters come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, context_ids: Sequence[int], skip_special_tokens: bool = True) -> StreamDecoder | None:
        """The backend's incremental decoder primed with `context_ids` (tokenizers' DecodeStream:
        one call a token, where decoding the window twice from Python was two), or None where
        the installed `tokenizers` has none (before 0.22), and where the context's text ends
        inside a character: a stream primed so treats the context as not yet emitted and would
        give its text with the first token. See IncrementalDetokenizer."""
        if _DecodeStream is None:
            return None
        if context_ids and self.decode(context_ids, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            return None
        try:
            stream = _DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        except TypeError:  # a DecodeStream that cannot be primed (tokenizers 0.21)
            return None
        return StreamDecoder(stream, self._backend)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary spelling of each id (byte-level alphabet for BPE, e.g. "Ġworld").

        Raises ValueError for an id outside the vocabulary.
        """
        tokens = []
        for token_id in ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary ({self.vocab_size} ids)"
                )
            tokens.append(token)
        return tokens

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding rows may be more)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._meta.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._meta.eos_token_id

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS plus end-of-turn tokens such as <|im_end|>, <|eot_id|>."""
        return self._meta.stop_token_ids

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of the special tokens (those `decode` skips by default)."""
        return sorted(self._special_ids)

    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template source, or None when it has none."""
        return self._meta.chat_template

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, rendered by the model's template as HF renders it.

        `kwargs` become template variables (e.g. `enable_thinking=False`). Raises ValueError when
        the model has no chat template, and jinja2.TemplateError when the template rejects the
        conversation (its `raise_exception`).
        """
        if self._meta.chat_template is None:
            raise ValueError(
                "this model has no chat template; send a plain completion prompt instead "
                "of chat messages"
            )
        return render_chat_template(
            self._meta.chat_template,
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=dict(self._meta.template_tokens),
            **kwargs,
        )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A Tokenizer for a GGUF file or an HF model folder.

    Raises FileNotFoundError when `path` is neither an existing folder nor an existing file, and
    ValueError for a file that is not GGUF.
    """
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}: expected a .gguf file or a model folder")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"{path} is not a GGUF file (magic {magic!r}); pass a GGUF file or a model folder"
        )
    return Tokenizer.from_gguf(path)
