"""Reading a GGUF file's tokenizer metadata and building a `tokenizers.Tokenizer` from it.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported: that is what llama.cpp calls
its BPE vocabulary type, used by SmolLM, Llama 3, Qwen2, GPT-2 and most recent models.
SentencePiece-style vocabularies (`"llama"`) raise ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, decoders, models, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine.tokenizer.meta import TokenizerMeta, stop_ids, template_tokens
from engine.tokenizer.pretokenize import build_pre_tokenizer, pre_tokenizer_spec

# llama.cpp's token types (`llama_token_type`): 1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused, 6 byte.
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer part of a GGUF file's metadata, as plain values."""

    model: str
    """`tokenizer.ggml.model`: llama.cpp's vocabulary type ("gpt2" is byte-level BPE)."""
    pre: str | None
    """`tokenizer.ggml.pre`: the pre-tokenizer family, None when the file does not say."""
    tokens: tuple[str, ...]
    """Token text by id, spelled in the byte-to-unicode alphabet for byte-level BPE."""
    token_types: tuple[int, ...]
    """llama.cpp token type by id (see TOKEN_TYPE_*); all normal (1) when the file has none."""
    merges: tuple[str, ...]
    """Merges in rank order, each "left right"."""
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    eot_token_id: int | None
    """`tokenizer.ggml.eot_token_id`: an explicit end-of-turn token, where the file names one."""
    add_bos_token: bool | None
    """None when the file has no `tokenizer.ggml.add_bos_token` key."""
    add_eos_token: bool | None
    chat_template: str | None


def read_gguf_vocab(path: str | Path) -> GGUFVocab:
    """Read the tokenizer metadata of the GGUF file at `path` (tensors are not loaded).

    Raises ValueError when the file has no `tokenizer.ggml.tokens`.
    """
    from engine.loader.gguf_meta import read_gguf_metadata

    get = read_gguf_metadata(path).get

    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: GGUF file has no tokenizer.ggml.tokens; cannot build one")
    token_types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    return GGUFVocab(
        model=get("tokenizer.ggml.model") or "",
        pre=get("tokenizer.ggml.pre"),
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in token_types),
        merges=tuple(get("tokenizer.ggml.merges") or ()),
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_id=get("tokenizer.ggml.eos_token_id"),
        unk_token_id=get("tokenizer.ggml.unknown_token_id"),
        pad_token_id=get("tokenizer.ggml.padding_token_id"),
        eot_token_id=get("tokenizer.ggml.eot_token_id"),
        add_bos_token=get("tokenizer.ggml.add_bos_token"),
        add_eos_token=get("tokenizer.ggml.add_eos_token"),
        chat_template=get("tokenizer.chat_template"),
    )


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp searches for the separating space from index 1, so a merge whose left side is
    # itself a space still splits where it should.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(f"malformed GGUF merge {merge!r}: no separating space")
    return merge[:cut], merge[cut + 1 :]


def build_backend(vocab: GGUFVocab, add_bos: bool, add_eos: bool) -> BackendTokenizer:
    """A `tokenizers.Tokenizer` that splits, merges and decodes as llama.cpp does for `vocab`.

    Control and unknown tokens become special added tokens and user-defined tokens plain added
    tokens, so their text in the input encodes to their id (llama.cpp's `parse_special=True`).
    `add_bos` / `add_eos` install a post-processor, applied when encode asks for special tokens.
    Raises ValueError for a vocabulary type or pre-tokenizer this module does not support.
    """
    if vocab.model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {vocab.model!r}; only byte-level BPE ('gpt2') is"
        )
    spec = pre_tokenizer_spec(vocab.pre)
    # Later duplicates win, as in llama.cpp's token_to_id map.
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    merges = [_split_merge(m) for m in vocab.merges]
    backend = BackendTokenizer(models.BPE(ids, merges, ignore_merges=spec.ignore_merges))
    backend.pre_tokenizer = build_pre_tokenizer(spec)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(vocab.tokens[i], special=True, normalized=False)
            for i, kind in enumerate(vocab.token_types)
            if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(vocab.tokens[i], special=False, normalized=False)
            for i, kind in enumerate(vocab.token_types)
            if kind == TOKEN_TYPE_USER_DEFINED
        ]
    )
    backend.post_processor = bos_eos_processor(
        backend,
        vocab.bos_token_id if add_bos else None,
        vocab.eos_token_id if add_eos else None,
    )
    return backend


def bos_eos_processor(
    backend: BackendTokenizer, bos_id: int | None, eos_id: int | None
) -> processors.PostProcessor | None:
    """A post-processor adding BOS before and/or EOS after each sequence; None adds nothing."""
    if bos_id is None and eos_id is None:
        return None
    specials: list[tuple[str, int]] = []
    before: list[str] = []
    after: list[str] = []
    if bos_id is not None:
        before.append(backend.id_to_token(bos_id))
        specials.append((before[0], bos_id))
    if eos_id is not None:
        after.append(backend.id_to_token(eos_id))
        specials.append((after[0], eos_id))

    def around(seq: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in before] + [f"{seq}:{type_id}"] + [
            f"{t}:{type_id}" for t in after
        ]

    return processors.TemplateProcessing(
        single=around("$A", 0), pair=around("$A", 0) + around("$B", 1), special_tokens=specials
    )


def load_gguf(path: str | Path) -> tuple[BackendTokenizer, TokenizerMeta]:
    """The backend tokenizer and its meta for the GGUF file at `path`.

    BOS is added on encode when the file's `add_bos_token` says so, or, when the key is absent,
    when llama.cpp would add it for this pre-tokenizer family. Raises ValueError for an
    unsupported vocabulary (see build_backend).
    """
    vocab = read_gguf_vocab(path)
    add_bos = vocab.add_bos_token
    if add_bos is None:
        add_bos = pre_tokenizer_spec(vocab.pre).add_bos_default
    backend = build_backend(vocab, add_bos=add_bos, add_eos=bool(vocab.add_eos_token))
    meta = TokenizerMeta(
        bos_token_id=vocab.bos_token_id,
        eos_token_id=vocab.eos_token_id,
        stop_token_ids=stop_ids(backend, [vocab.eos_token_id, vocab.eot_token_id]),
        chat_template=vocab.chat_template,
        template_tokens=template_tokens(
            backend,
            bos_token=vocab.bos_token_id,
            eos_token=vocab.eos_token_id,
            unk_token=vocab.unk_token_id,
            pad_token=vocab.pad_token_id,
        ),
    )
    return backend, meta
