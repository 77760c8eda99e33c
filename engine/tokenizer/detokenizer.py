"""Turning a stream of generated token ids into a stream of text, one delta per step.

A token can end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK over
several tokens), and decoding a token alone can lose a leading space (SentencePiece). So, as in
vLLM, each step decodes a short window twice: the already-emitted tokens
`ids[prefix_offset:read_offset]` and the same window plus the new tokens `ids[prefix_offset:]`.
The difference is the new text. When it ends in U+FFFD (an unfinished character), nothing is
emitted and the offsets stay, so the next token completes the character; if none does (the
request ends), the unfinished character is dropped, never emitted as U+FFFD.

Where the installed `tokenizers` has DecodeStream (0.22+), each step runs there instead: the
same window, offsets and rule in one backend call a token, with the emitted text kept rather
than decoded again (~1.2 against ~2.5 us a token here, on SmolLM2's vocabulary). The deltas
stay the window decode's: a context that ends inside a character keeps the window decode
(Tokenizer.stream_decoder), and once a decoder rewrites text it already gave (a byte-fallback
run; no byte-level BPE does), that step and every later one are decoded here. One corner
differs: a rewrite that leaves the text no longer in bytes but longer in characters is held
back there, where the window decode emits its mis-sliced tail.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer.tokenizer import Tokenizer

# How many prompt tokens the first window reaches back, so the first output token decodes with
# the context that decides its leading space (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes one request's output ids incrementally. Not thread-safe; one per request."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids)
        self._num_prompt = len(self._ids)
        # Invariant: ids[prefix_offset:read_offset] is already emitted and starts at a character
        # boundary (or inside the prompt); ids[read_offset:] is not yet emitted.
        self._prefix_offset = max(self._num_prompt - INITIAL_CONTEXT_TOKENS, 0)
        self._read_offset = self._num_prompt
        self._text_parts: list[str] = []
        self._stream = tokenizer.stream_decoder(self._ids[self._prefix_offset :], skip_special_tokens)

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back partial characters excluded)."""
        return "".join(self._text_parts)

    @property
    def output_token_ids(self) -> list[int]:
        """The output ids added so far (a copy)."""
        return self._ids[self._num_prompt :]

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (may be "", never half a character).

        Mutates this detokenizer. Ids are decoded one at a time, so the result equals feeding
        them one per call and joining the deltas.
        """
        deltas = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            deltas.append(self._step())
        delta = "".join(deltas)
        self._text_parts.append(delta)
        return delta

    def flush(self) -> str:
        """Emit what is held back when generation ends, unless it ends in U+FFFD.

        Held-back text ends in U+FFFD when the last tokens stopped inside a character
        (max_tokens or a stop cut it): it is dropped, so text never ends in a replacement
        character that the model did not write. vLLM emits nothing at the end either; as there,
        a genuine U+FFFD that is the very last character cannot be told from a cut one and goes
        too (in the middle of the text it is emitted once the next token follows).
        Call once when generation ends; mutates this detokenizer.
        """
        prefix_text, new_text = self._decode_window()
        self._prefix_offset = self._read_offset = len(self._ids)
        delta = new_text[len(prefix_text) :]
        if delta.endswith(_REPLACEMENT_CHAR):
            delta = ""
        self._text_parts.append(delta)
        return delta

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset :]
        emitted = self._read_offset - self._prefix_offset
        skip = self._skip_special_tokens
        prefix_text = decode(window[:emitted], skip_special_tokens=skip)
        return prefix_text, decode(window, skip_special_tokens=skip)

    def _step(self) -> str:
        if self._stream is not None:
            try:
                text = self._stream.step(self._ids[-1])
            except Exception:  # the window's text no longer starts with what was emitted
                self._stream = None
            else:
                if text is None:
                    return ""
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                return text
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
