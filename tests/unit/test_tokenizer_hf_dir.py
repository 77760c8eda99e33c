"""Tokenizer.from_hf_dir on a folder written by HF transformers (tokenizer.json and friends)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.loader.locate import default_model_path
from engine.tokenizer import Tokenizer, load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STRINGS = json.loads((FIXTURES / "tokenizer_strings.json").read_text(encoding="utf-8"))
USER_HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_folder(hf_tok, tmp_path_factory) -> Path:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja as transformers saves them."""
    folder = tmp_path_factory.mktemp("smollm2-hf")
    hf_tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tok(hf_folder) -> Tokenizer:
    return Tokenizer.from_hf_dir(hf_folder)


def variant(base: Path, dest: Path, config: dict | None = None, **files: object) -> Path:
    """A copy of `base`'s tokenizer.json with the given config and extra JSON files."""
    dest.mkdir()
    shutil.copy(base / "tokenizer.json", dest / "tokenizer.json")
    if config is not None:
        (dest / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, content in files.items():
        (dest / f"{name}.json").write_text(json.dumps(content), encoding="utf-8")
    return dest


def test_ids_equal_hf_for_all_fixture_strings(tok, hf_tok):
    assert [s for s in STRINGS if tok.encode(s) != hf_tok.encode(s)] == []


def test_chat_template_from_jinja_file_renders_like_hf(tok, hf_tok):
    assert tok.apply_chat_template(USER_HI) == hf_tok.apply_chat_template(
        USER_HI, tokenize=False, add_generation_prompt=True
    )


def test_special_ids_come_from_token_strings_in_the_config(tok):
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.stop_token_ids == frozenset({0, 2, 4})
    assert tok.all_special_ids == list(range(17))
    assert tok.vocab_size == 49152


def test_add_bos_token_in_config_prepends_bos_only_with_special_tokens(hf_folder, tmp_path):
    config = {"bos_token": "<|im_start|>", "add_bos_token": True}
    folder = variant(hf_folder, tmp_path / "m", config)
    tok = Tokenizer.from_hf_dir(folder)
    assert tok.encode("Hello world") == [1, 19556, 905]
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]


def test_generation_config_eos_ids_all_stop(hf_folder, tmp_path):
    generation_config = {"eos_token_id": [2, 7]}
    folder = variant(
        hf_folder, tmp_path / "m", {"eos_token": "<|im_end|>"}, generation_config=generation_config
    )
    tok = Tokenizer.from_hf_dir(folder)
    assert tok.eos_token_id == 2
    assert tok.stop_token_ids == frozenset({0, 2, 4, 7})


def test_eos_falls_back_to_generation_config_when_config_names_none(hf_folder, tmp_path):
    folder = variant(hf_folder, tmp_path / "m", generation_config={"eos_token_id": 0})
    assert Tokenizer.from_hf_dir(folder).eos_token_id == 0


def test_named_template_list_in_config_uses_the_default_entry(hf_folder, tmp_path):
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0]['content'] }}!"},
    ]
    folder = variant(hf_folder, tmp_path / "m", {"chat_template": templates})
    assert Tokenizer.from_hf_dir(folder).apply_chat_template(USER_HI) == "Hi!"


def test_folder_without_template_has_none_and_refuses_chat(hf_folder, tmp_path):
    tok = Tokenizer.from_hf_dir(variant(hf_folder, tmp_path / "m"))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(USER_HI)


def test_folder_without_tokenizer_json_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_load_tokenizer_picks_hf_loading_for_a_folder(hf_folder):
    assert load_tokenizer(hf_folder).encode("<|im_start|>user") == [1, 4093]
