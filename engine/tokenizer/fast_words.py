"""A faster encode for short text, with the same ids as the backend's.

`tokenizers` spends most of a short prompt's encode outside the BPE merges: Unicode regex splits
(Oniguruma) and per-character alignment bookkeeping, ~70-100 us for a 32-token prompt warm and
~350 us when the rest of a request has pushed its tables out of the CPU's caches, which is every
request in the router (here: ~15-80 us and ~80-115 us). Python's `re` does the same splits in a
few microseconds: on ASCII text with ASCII classes (`\\p{L}` is [A-Za-z], `\\p{N}` is [0-9]),
on other text with the classes of unicode_classes.py (Unicode 14.0's letters and numbers, and
Oniguruma's white space); each piece then goes through the same BPE model, with its ids kept in
a bounded per-piece cache (natural text repeats its words; the model keeps a cache of its own
for the same reason).

`FastWordEncoder.for_backend` builds one only for a backend it can reproduce exactly: no
normalizer, a pre-tokenizer that is a chain of known regex splits (see split_patterns; ours for
GGUF files) or single-digit splits ending in the byte-level mapping (with or without its own
GPT-2 regex, HF folders' usual form), a plain byte-level BPE model, and added tokens matched as
written (no stripping around them). Added tokens written in the text (a chat template's
"<|im_start|>") map to their ids as the backend maps them. Text longer than MAX_CHARS, with a
character beyond the Basic Multilingual Plane (emoji), or with one unassigned in Unicode 14.0 (or
a lone surrogate), goes to the backend as before. Equality with the backend is tested on the
default model's vocabulary, every assigned character of that plane included
(tests/unit/test_tokenizer_fast_words.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from engine.tokenizer import unicode_classes
from engine.tokenizer.pretokenize import GPT2_SPLIT

__all__ = ["MAX_CHARS", "FastWordEncoder", "split_patterns"]

MAX_CHARS = 4096
"""Longer text goes to the backend, whose batch call releases the GIL (a long prompt may be
tokenized in a worker thread while the event loop runs)."""

MAX_CACHED = 1 << 16
"""Pieces kept; the cache is emptied when it reaches this many."""

MAX_CACHED_CHARS = 64
"""Longer pieces (whitespace runs, long identifiers) are encoded every time, not kept."""

# Oniguruma's \s on ASCII is exactly these six (not \x1c-\x1f, which Python's \s adds); beyond
# ASCII it is the Unicode White_Space property (Python's str.isspace() differs there too).
_WS = r"\t\n\x0b\x0c\r "
_WS_BEYOND_ASCII = r"\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def split_patterns(letter: str, number: str, space: str) -> dict[str, str]:
    """Backend split patterns (as pretokenize.py writes them) -> the same split with these
    character classes (the inside of `[...]`) for \\p{L}, \\p{N} and \\s."""
    return {
        r"\p{N}": f"[{number}]",
        GPT2_SPLIT: (
            rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letter}]+| ?[{number}]+| ?[^{space}{letter}{number}]+"
            rf"|[{space}]+(?![^{space}])|[{space}]+"
        ),
    }


_ASCII_SPLITS = split_patterns("A-Za-z", "0-9", _WS)
_unicode: tuple[dict[str, str], re.Pattern[str]] | None = None


def _unicode_splits() -> tuple[dict[str, str], re.Pattern[str]]:
    """The patterns for text within the Basic Multilingual Plane, and the characters that send
    such text to the backend; built on first use (compiling the classes takes ~40 ms)."""
    global _unicode
    if _unicode is None:
        letter = "A-Za-z" + unicode_classes.char_class(unicode_classes.LETTER)
        number = "0-9" + unicode_classes.char_class(unicode_classes.NUMBER)
        unsure = re.compile("[" + unicode_classes.char_class(unicode_classes.UNASSIGNED) + "]")
        _unicode = split_patterns(letter, number, _WS + _WS_BEYOND_ASCII), unsure
    return _unicode


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's spelling of each byte: printable Latin-1 bytes stand for themselves, the
    others (control characters, space, ...) take the code points from 256 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    spelling = {b: chr(b) for b in kept}
    moved = (b for b in range(256) if b not in spelling)
    spelling.update((b, chr(256 + n)) for n, b in enumerate(moved))
    return spelling


_SPELLING = _byte_alphabet()
"""As a str.translate table: a text's UTF-8 bytes, read as Latin-1, to their spelling."""
_ASCII_SPELLING = {b: c for b, c in _SPELLING.items() if b < 128}


class FastWordEncoder:
    """encode() for short text, equal to the backend's; `None` from encode means "ask the
    backend". Safe to share between threads (the cache is a dict, read and written whole)."""

    def __init__(self, model: models.Model, splits: list[str], added: dict[str, int],
                 around: tuple[list[int], list[int]]) -> None:
        """splits: the backend's split patterns, in order (keys of split_patterns)."""
        self._tokenize = model.tokenize
        self._splits = splits
        self._ascii_split = _splitter([_ASCII_SPLITS[key] for key in splits])
        self._any_split: Callable[[str], list[str]] | None = None
        # The backend finds added tokens in the raw text first, leftmost and then longest, and
        # splits the text between them on its own: one alternation, longest first, does the same.
        spellings = sorted(added, key=len, reverse=True)
        self._added = re.compile("(" + "|".join(map(re.escape, spellings)) + ")") if spellings else None
        self._added_ids = added
        self._before, self._after = around
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def for_backend(cls, backend: BackendTokenizer) -> FastWordEncoder | None:
        """An encoder reproducing `backend`, or None where this module cannot."""
        model = backend.model
        if backend.normalizer is not None or not _plain_byte_level_bpe(model):
            return None
        splits = _known_splits(backend)
        added = backend.get_added_tokens_decoder()
        # Stripping around a token or matching it as a whole word only is the backend's to do.
        if splits is None or any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            return None
        return cls(model, splits, {t.content: i for i, t in sorted(added.items())}, _special_ids_around(backend))

    def encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The backend's ids for `text`, or None when the backend must encode it."""
        if len(text) > MAX_CHARS:
            return None
        if text.isascii():
            split = self._ascii_split
        else:
            # Beyond the BMP (emoji, rarer CJK) the classes would be slow to look up (see
            # unicode_classes.char_class): the backend does it.
            if max(text) > "\uffff":
                return None
            patterns, unsure = _unicode_splits()
            if unsure.search(text):
                return None
            if self._any_split is None:
                self._any_split = _splitter([patterns[key] for key in self._splits])
            split = self._any_split
        ids = list(self._before) if add_special_tokens else []
        if self._added is None:
            self._encode_text(text, split, ids)
        else:  # text, token, text, ..., text (a chat template's turns)
            for k, part in enumerate(self._added.split(text)):
                if k % 2:
                    ids.append(self._added_ids[part])
                elif part:
                    self._encode_text(part, split, ids)
        if add_special_tokens:
            ids += self._after
        return ids

    def _encode_text(self, text: str, split: Callable[[str], list[str]], ids: list[int]) -> None:
        cache = self._cache
        for piece in split(text):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = self._encode_piece(piece)
            ids += piece_ids

    def _encode_piece(self, piece: str) -> list[int]:
        spelled = (piece.translate(_ASCII_SPELLING) if piece.isascii()
                   else piece.encode("utf-8").decode("latin-1").translate(_SPELLING))
        ids = [token.id for token in self._tokenize(spelled)]
        if len(piece) <= MAX_CACHED_CHARS:
            if len(self._cache) >= MAX_CACHED:
                self._cache = {}
            self._cache[piece] = ids
        return ids


def _plain_byte_level_bpe(model: models.Model) -> bool:
    return (isinstance(model, models.BPE) and not model.ignore_merges and not model.byte_fallback
            and model.dropout is None and not model.continuing_subword_prefix
            and not model.end_of_word_suffix)


def _known_splits(backend: BackendTokenizer) -> list[str] | None:
    """The backend's split patterns (keys of split_patterns), when its pre-tokenizer is a chain
    of known isolated regex splits (or single-digit splits) ending in the byte-level mapping;
    that mapping's own regex (`use_regex`, HF's GPT-2 default) is the GPT-2 split."""
    if backend.pre_tokenizer is None:
        return None
    config = json.loads(backend.pre_tokenizer.__getstate__())
    steps = config.get("pretokenizers", []) if config.get("type") == "Sequence" else [config]
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return None
    patterns = []
    for step in steps[:-1]:
        pattern = step.get("pattern", {}).get("Regex")
        if step == {"type": "Digits", "individual_digits": True}:
            patterns.append(r"\p{N}")
        elif (step.get("type") == "Split" and step.get("behavior") == "Isolated" and not step.get("invert")
                and pattern in _ASCII_SPLITS):
            patterns.append(pattern)
        else:
            return None
    if steps[-1].get("use_regex"):
        patterns.append(GPT2_SPLIT)
    return patterns or None


def _special_ids_around(backend: BackendTokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a sequence (BOS / EOS), found by
    encoding one letter with and without them."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    raise ValueError(f"post-processor output {full} does not contain the sequence {plain}")


def _splitter(patterns: list[str]) -> Callable[[str], list[str]]:
    """Each pattern splits the pieces the previous one made; text between matches is a piece
    too (the backend's "isolated" behaviour: re.split with the whole pattern as its group)."""
    splits = [re.compile(f"({pattern})") for pattern in patterns]
    if len(splits) == 1:
        only = splits[0].split
        return lambda text: [part for part in only(text) if part]

    def split(text: str) -> list[str]:
        pieces = [text]
        for pattern in splits:
            pieces = [part for piece in pieces for part in pattern.split(piece) if part]
        return pieces
    return split
