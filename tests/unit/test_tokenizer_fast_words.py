"""The fast path of encode gives the backend's ids (special tokens written in the text
included) on ASCII text and on text in any script, or steps aside for the backend."""

from __future__ import annotations

import dataclasses
import random

import pytest

from engine.loader.locate import default_model_path
from engine.tokenizer import Tokenizer, fast_words
from engine.tokenizer.fast_words import MAX_CHARS, FastWordEncoder
from engine.tokenizer.gguf_vocab import build_backend, load_gguf, read_gguf_vocab
from engine.tokenizer.hf_dir import load_hf_dir

PIECES = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", " 's", "  ", "\n\n", "\r\n", "\t", " 123",
          "hello", " world", "<|im_start|>", "<|im_end|>", "<repo", "|>", "http://x.y/z?a=1", "...",
          "  x", "1.5e-3", "\x0b\x0c", "\x1c\x1f", "\x7f", "Hello, World!", "<repo_name>", "<reponame>",
          "<|endoftext|>", "<|im_end|>\n", "<|im_start", "<file_sep", ">"]


def random_ascii(rng: random.Random, count: int) -> list[str]:
    """Text mixing every ASCII character with contractions, whitespace runs, digits and
    special-token spellings, where the splits differ most."""
    texts = []
    for _ in range(count):
        parts = rng.randint(0, 40)
        texts.append("".join(chr(rng.randrange(128)) if rng.random() < 0.5 else rng.choice(PIECES)
                             for _ in range(parts)))
    return texts


@pytest.fixture(scope="module")
def smollm_backend():
    return load_gguf(default_model_path())[0]


def backend_ids(backend, text: str, add_special_tokens: bool) -> list[int]:
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def test_equals_the_backend_on_random_ascii_text(smollm_backend):
    fast = FastWordEncoder.for_backend(smollm_backend)
    assert fast is not None
    for text in random_ascii(random.Random(0), 3000):
        assert fast.encode(text, False) == backend_ids(smollm_backend, text, False), repr(text)


def test_equals_the_backend_with_bos_and_eos_and_the_gpt2_split():
    vocab = dataclasses.replace(read_gguf_vocab(default_model_path()), pre="gpt-2")
    backend = build_backend(vocab, add_bos=True, add_eos=True)
    fast = FastWordEncoder.for_backend(backend)
    assert fast is not None
    for text in random_ascii(random.Random(1), 1000) + random_unicode(random.Random(4), 500) + ["", "a 12345 b"]:
        for add in (True, False):
            assert fast.encode(text, add) == backend_ids(backend, text, add), (repr(text), add)
    assert fast.encode("", True) == backend_ids(backend, "", True) != []


def test_steps_aside_for_long_text_unassigned_characters_and_lone_surrogates(smollm_backend):
    fast = FastWordEncoder.for_backend(smollm_backend)
    assert fast.encode("a" * (MAX_CHARS + 1), False) is None
    assert fast.encode("a" * MAX_CHARS, False) == backend_ids(smollm_backend, "a" * MAX_CHARS, False)
    assert fast.encode("caf\u00e9", False) == backend_ids(smollm_backend, "caf\u00e9", False)
    # U+0870 is a letter since Unicode 14.0, U+2FFC a symbol since 15.1 (unassigned in 14.0)
    assert fast.encode("ab\u0870cd", False) == backend_ids(smollm_backend, "ab\u0870cd", False)
    assert fast.encode("ab\u2ffccd", False) is None
    assert fast.encode("ab\ud800cd", False) is None
    assert fast.encode("ok \U0001f600", False) is None  # beyond the BMP: the backend's


def assigned_beyond_ascii(up_to: int = 0x10FFFF) -> list[str]:
    """Every character assigned in Unicode 14.0 beyond ASCII up to `up_to`, surrogates left out."""
    from engine.tokenizer.unicode_classes import UNASSIGNED

    unassigned = set()
    for item in UNASSIGNED.split():
        lo, _, hi = item.partition("-")
        unassigned.update(range(int(lo, 16), int(hi or lo, 16) + 1))
    return [chr(cp) for cp in range(0x80, up_to + 1) if cp not in unassigned]


def test_every_assigned_character_splits_as_the_backend_splits_it(smollm_backend):
    """Each of the ~55,000 characters of the Basic Multilingual Plane (the rest go to the
    backend) in contexts where its class decides the split (beside letters, digits, a space,
    itself, a no-break space, a contraction)."""
    fast = FastWordEncoder.for_backend(smollm_backend)
    chars = assigned_beyond_ascii(0xFFFF)
    contexts = [f"a{c}1 {c}{c}\u00a0{c}'s {c}" for c in chars]
    texts = ["\n".join(contexts[k:k + 8]) for k in range(0, len(contexts), 8)]  # 8 to a call
    want = [e.ids for e in smollm_backend.encode_batch_fast(texts, add_special_tokens=False)]
    got = [fast.encode(text, False) for text in texts]
    assert None not in got
    bad = [text for text, ids, mine in zip(texts, want, got) if mine != ids]
    assert not bad, [ascii(t) for t in bad[:10]]


def random_unicode(rng: random.Random, count: int) -> list[str]:
    """random_ascii's pieces mixed with characters from the whole assigned Basic Multilingual
    Plane (letters, marks, digits of other scripts, Unicode spaces, symbols, CJK)."""
    chars = assigned_beyond_ascii(0xFFFF)
    spaces = ["\u00a0", "\u3000", "\u2009", "\u0085", "\u1680", "\u202f", "\u2028"]
    texts = []
    for _ in range(count):
        parts = rng.randint(0, 40)
        texts.append("".join(
            rng.choice(chars) if (r := rng.random()) < 0.4 else rng.choice(spaces) if r < 0.5
            else chr(rng.randrange(128)) if r < 0.75 else rng.choice(PIECES) for _ in range(parts)))
    return texts


def test_equals_the_backend_on_random_text_in_any_script(smollm_backend):
    fast = FastWordEncoder.for_backend(smollm_backend)
    texts = random_unicode(random.Random(3), 3000) + ["Grüße, 世界! ١٢٣ ½ café\u00a0au lait ☺"]
    for text in texts:
        assert fast.encode(text, False) == backend_ids(smollm_backend, text, False), ascii(text)


def test_the_frozen_unicode_classes_are_unicode_14s():
    import unicodedata

    from engine.tokenizer import unicode_classes as classes

    if unicodedata.unidata_version != "14.0.0":
        pytest.skip(f"this Python's unicodedata is {unicodedata.unidata_version}; the classes are 14.0.0's")
    assert classes.ranges_of("L") == classes.LETTER
    assert classes.ranges_of("N") == classes.NUMBER
    assert classes.ranges_of("unassigned") == classes.UNASSIGNED


def test_a_rendered_chat_prompt_takes_the_fast_path_with_its_special_tokens():
    tok = Tokenizer.from_gguf(default_model_path())
    backend = load_gguf(default_model_path())[0]
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "What's 2+2? Say it twice."}],
                                     add_generation_prompt=True)
    fast = FastWordEncoder.for_backend(backend)
    assert prompt.startswith("<|im_start|>system")
    assert fast.encode(prompt, True) == backend_ids(backend, prompt, True)
    assert fast.encode(prompt, True)[0] == backend.token_to_id("<|im_start|>")


def test_no_fast_path_for_splits_it_does_not_know():
    vocab = dataclasses.replace(read_gguf_vocab(default_model_path()), pre="llama3")
    assert FastWordEncoder.for_backend(build_backend(vocab, add_bos=True, add_eos=False)) is None


def test_tokenizer_encode_and_encode_many_mix_both_paths():
    tok = Tokenizer.from_gguf(default_model_path())
    backend = load_gguf(default_model_path())[0]
    texts = ["Hello there, how are you?", "caf\u00e9 au lait", "<|im_start|>user\nhi<|im_end|>", "", "x" * 5000,
             "ok \U0001f600!", "\u4e16\u754c"]
    expected = [backend_ids(backend, t, True) for t in texts]
    assert tok.encode_many(texts) == expected
    assert [tok.encode(t) for t in texts] == expected


def test_the_piece_cache_is_bounded(smollm_backend, monkeypatch):
    monkeypatch.setattr(fast_words, "MAX_CACHED", 50)
    fast = FastWordEncoder.for_backend(smollm_backend)
    text = " ".join(f"w{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}" for i in range(400))
    assert fast.encode(text, False) == backend_ids(smollm_backend, text, False)
    assert fast.encode(text, False) == backend_ids(smollm_backend, text, False)
    assert len(fast._cache) <= 50


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The tokenizer.json HF transformers writes for the default model: a byte-level
    pre-tokenizer with the GPT-2 regex of its own (use_regex), no digit split."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    folder = tmp_path_factory.mktemp("smollm2-hf")
    transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
    return folder


@pytest.fixture
def hf_folder_backend(hf_folder):
    return load_hf_dir(hf_folder)[0]


def test_equals_an_hf_folders_tokenizer_and_its_digit_splitting_variant(hf_folder_backend):
    from tokenizers import pre_tokenizers

    backend = hf_folder_backend
    variants = [None, pre_tokenizers.Sequence([  # SmolLM2's own tokenizer.json
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])]
    for variant in variants:
        if variant is not None:
            backend.pre_tokenizer = variant
        fast = FastWordEncoder.for_backend(backend)
        assert fast is not None
        for text in random_ascii(random.Random(2), 1000) + random_unicode(random.Random(5), 500) + [
                "a 12345 b", "x  42", "x \u0661\u0662 \u00bd"]:
            assert fast.encode(text, True) == backend_ids(backend, text, True), ascii(text)


def test_no_fast_path_where_the_byte_level_step_adds_a_prefix_space(hf_folder_backend):
    from tokenizers import pre_tokenizers

    hf_folder_backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    assert FastWordEncoder.for_backend(hf_folder_backend) is None
