"""What a Tokenizer knows besides its vocabulary: special ids, stop ids, the chat template."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer as BackendTokenizer

# Token texts that end a turn or a document. This is llama.cpp's end-of-generation list
# (`special_eog_ids` in llama-vocab.cpp), so a GGUF model stops where llama.cpp stops it.
END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
    # Fill-in-the-middle padding, repository and file separators: llama.cpp also ends generation
    # on these, as a code model emitting one has finished the file it was asked for.
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
)


@dataclass(frozen=True)
class TokenizerMeta:
    """Model-level facts about a tokenizer, read once from its files."""

    bos_token_id: int | None
    eos_token_id: int | None
    stop_token_ids: frozenset[int]
    """Ids that end generation: EOS plus end-of-turn tokens (see END_OF_TURN_TOKENS)."""
    chat_template: str | None
    """Jinja source of the model's chat template; None when the model has none."""
    template_tokens: tuple[tuple[str, str], ...]
    """Special token strings a chat template may read, e.g. (("bos_token", "<s>"),)."""


def special_ids(backend: BackendTokenizer) -> frozenset[int]:
    """Ids of the added tokens flagged special (skipped by `decode(skip_special_tokens=True)`)."""
    return frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)


def stop_ids(backend: BackendTokenizer, explicit: Iterable[int | None]) -> frozenset[int]:
    """`explicit` ids (EOS and the like; None entries ignored) plus every special token whose
    text is in END_OF_TURN_TOKENS. A non-special token spelled like one (a plain "</s>") is not.
    """
    specials = special_ids(backend)
    ids = {i for i in explicit if i is not None}
    for text in END_OF_TURN_TOKENS:
        token_id = backend.token_to_id(text)
        if token_id is not None and token_id in specials:
            ids.add(token_id)
    return frozenset(ids)

def template_tokens(backend: BackendTokenizer, **ids: int | None) -> tuple[tuple[str, str], ...]:
    """(name, text) for each named id that is set, e.g. template_tokens(b, bos_token=1)."""
    pairs = []
    for name, token_id in ids.items():
        text = None if token_id is None else backend.id_to_token(token_id)
        if text is not None:
            pairs.append((name, text))
    return tuple(pairs)
