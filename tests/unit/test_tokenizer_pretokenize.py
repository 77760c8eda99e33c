"""GGUF pre-tokenizer families: how each splits text before BPE merges (no model needed)."""

from __future__ import annotations

import pytest

from engine.tokenizer.pretokenize import build_pre_tokenizer, pre_tokenizer_spec

SAMPLE = "I'M here  12345 \u00bd!\n\n  x"


def pieces(pre: str | None, text: str = SAMPLE) -> list[str]:
    """Pre-tokenized pieces, in the byte-level alphabet (Ġ is a space, Ċ a newline)."""
    pre_tokenizer = build_pre_tokenizer(pre_tokenizer_spec(pre))
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def test_smollm_isolates_each_digit_and_keeps_the_space_run_before_it_whole():
    assert pieces("smollm") == [
        "I", "'", "M", "Ġhere", "ĠĠ", "1", "2", "3", "4", "5", "Ġ", "Â½", "!", "ĊĊĠ", "Ġx",
    ]  # fmt: skip


def test_gpt2_attaches_a_space_to_the_number_after_it():
    assert pieces("gpt-2") == ["I", "'", "M", "Ġhere", "Ġ", "Ġ12345", "ĠÂ½", "!", "ĊĊĠ", "Ġx"]


def test_llama3_groups_digits_by_three_and_matches_contractions_in_any_case():
    assert pieces("llama-bpe") == [
        "I", "'M", "Ġhere", "Ġ", "Ġ", "123", "45", "Ġ", "Â½", "!ĊĊ", "Ġ", "Ġx",
    ]  # fmt: skip


def test_qwen2_isolates_each_digit():
    assert pieces("qwen2", "abc 2024") == ["abc", "Ġ", "2", "0", "2", "4"]


def test_missing_pre_type_uses_llama_cpp_default_split():
    assert pieces(None, "x=12345") == ["x", "=", "123", "45"]


def test_llama3_family_skips_merges_for_whole_tokens_and_adds_bos_by_default():
    llama3, smollm = pre_tokenizer_spec("llama-bpe"), pre_tokenizer_spec("smollm")
    assert (llama3.ignore_merges, llama3.add_bos_default) == (True, True)
    assert (smollm.ignore_merges, smollm.add_bos_default) == (False, False)


def test_unknown_pre_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match="supported: .*smollm"):
        pre_tokenizer_spec("no-such-pre")
