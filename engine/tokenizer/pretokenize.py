"""Pre-tokenizer splits for byte-level BPE vocabularies stored in GGUF files.

A GGUF names its pre-tokenizer by a string (`tokenizer.ggml.pre`); llama.cpp maps each name to a
list of regexes applied one after another, each splitting the pieces the previous one produced
(`llm_tokenizer_bpe` in llama.cpp's `llama-vocab.cpp`). We rebuild the same chain with
`tokenizers` `Split(..., behavior="isolated")` steps, which, like llama.cpp, keep the text between
matches as pieces of their own. Where llama.cpp rewrote a regex for its own engine (e.g. `(?i:...)`
spelled out as `[sS]`), we use the original pattern from the model's `tokenizer.json`; both split
alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# GPT-2's pattern. llama.cpp leaves off the final `|\s+`, but its splitter emits the whitespace it
# does not match as pieces anyway, so the two split identically.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp pre-tokenizes one family of byte-level BPE vocabularies."""

    splits: tuple[str, ...]
    """Regexes applied in order; each one splits every piece the previous one produced."""
    ignore_merges: bool = False
    """A piece that is already a whole vocabulary token is emitted as is, without running merges."""
    add_bos_default: bool = False
    """Whether llama.cpp adds BOS for this family when the file has no `add_bos_token` key."""


_SMOLLM = PreTokenizerSpec(splits=(r"\p{N}", GPT2_SPLIT))
_GPT2 = PreTokenizerSpec(splits=(GPT2_SPLIT,))
_LLAMA3 = PreTokenizerSpec(splits=(LLAMA3_SPLIT,), ignore_merges=True, add_bos_default=True)
_QWEN2 = PreTokenizerSpec(splits=(QWEN2_SPLIT,))

# Names as llama.cpp spells them in `tokenizer.ggml.pre`, grouped as llama.cpp groups them.
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec(splits=DEFAULT_SPLITS),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _SMOLLM
    ),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jina-es", "jina-de", "roberta-bpe"), _GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3),
    # Same split as llama3, but llama.cpp runs the merges for these.
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizerSpec(splits=(LLAMA3_SPLIT,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2),
}


def pre_tokenizer_spec(pre: str | None) -> PreTokenizerSpec:
    """The spec for a GGUF `tokenizer.ggml.pre` value; a missing value means llama.cpp's default.

    Raises ValueError naming the supported values when `pre` is unknown.
    """
    if pre is None or pre == "":
        return PRE_TOKENIZERS["default"]
    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {known}")
    return PRE_TOKENIZERS[pre]


def build_pre_tokenizer(spec: PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    """The regex splits in order, then the byte-to-unicode mapping of byte-level BPE."""
    steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in spec.splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
