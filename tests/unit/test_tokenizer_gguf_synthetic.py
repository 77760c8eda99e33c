"""Tokenizer.from_gguf on tiny GGUF files written here, for the metadata the default model lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFWriter

from engine.tokenizer import Tokenizer

# ids:      0      1       2           3    4    5     6    7
TOKENS = ["<s>", "</s>", "<|eot_id|>", "a", "b", "ab", "Ġ", "<think>"]
# llama.cpp token types: 3 control, 1 normal, 4 user-defined.
TYPES = [3, 3, 3, 1, 1, 1, 1, 4]


def write_gguf(
    path: Path,
    pre: str = "llama-bpe",
    model: str = "gpt2",
    add_bos: bool | None = None,
    chat_template: str | None = None,
) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TYPES)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama3_family_adds_bos_when_the_file_does_not_say(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf"))
    assert tok.encode("ab a") == [0, 5, 6, 3]
    assert tok.encode("ab a", add_special_tokens=False) == [5, 6, 3]


def test_add_bos_token_false_in_the_file_wins_over_the_family_default(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", add_bos=False))
    assert tok.encode("ab") == [5]


def test_eot_token_stops_and_control_tokens_are_special(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf"))
    assert tok.stop_token_ids == frozenset({1, 2})
    assert tok.all_special_ids == [0, 1, 2]


def test_user_defined_token_is_matched_whole_but_not_skipped_on_decode(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", add_bos=False))
    assert tok.encode("a<think>b") == [3, 7, 4]
    assert tok.decode([3, 7, 4, 1]) == "a<think>b"


def test_missing_chat_template_is_none(tmp_path):
    assert Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf")).chat_template is None


def test_chat_template_is_read_from_metadata(tmp_path):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", chat_template="{{ bos_token }}hi"))
    assert tok.apply_chat_template([]) == "<s>hi"


def test_sentencepiece_vocabulary_is_rejected_with_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="only byte-level BPE"):
        Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", model="llama"))


def test_unknown_pre_tokenizer_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", pre="mystery"))
