"""IncrementalDetokenizer on the default model's byte-level BPE vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.loader.locate import default_model_path
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STRINGS = json.loads((FIXTURES / "tokenizer_strings.json").read_text(encoding="utf-8"))

GRINNING = [10813, 242, 218]  # "😀" as three byte-level tokens: ðŁ ĺ Ģ
SPACE_NIHON = [17097, 241, 115, 40993]  # " 日本": Ġæ Ĺ ¥ æľ¬


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def chat_prompt(tok) -> list[int]:
    return tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([token_id]) for token_id in ids]


def test_emoji_over_three_tokens_comes_out_whole_on_the_last(tok, chat_prompt):
    detok = IncrementalDetokenizer(tok, chat_prompt)
    assert stream(detok, GRINNING) == ["", "", "\U0001F600"]
    assert detok.text == "\U0001F600"


def test_cjk_characters_are_emitted_as_each_completes(tok, chat_prompt):
    detok = IncrementalDetokenizer(tok, chat_prompt)
    assert stream(detok, SPACE_NIHON) == ["", "", " 日", "本"]


def test_leading_space_of_first_output_token_is_kept(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    assert detok.add(tok.encode(" world")) == " world"


def test_special_tokens_are_skipped_by_default(tok, chat_prompt):
    detok = IncrementalDetokenizer(tok, chat_prompt)
    assert stream(detok, tok.encode("Done.<|im_end|>")) == ["Done", ".", ""]
    assert detok.text == "Done."


def test_special_tokens_are_emitted_when_not_skipped(tok, chat_prompt):
    detok = IncrementalDetokenizer(tok, chat_prompt, skip_special_tokens=False)
    assert stream(detok, tok.encode("Done.<|im_end|>")) == ["Done", ".", "<|im_end|>"]


def test_adding_many_ids_at_once_returns_their_joined_text(tok, chat_prompt):
    detok = IncrementalDetokenizer(tok, chat_prompt)
    assert detok.add(tok.encode("Hi 😀!")) == "Hi 😀!"
    assert detok.output_token_ids == tok.encode("Hi 😀!")


def test_ids_ending_mid_character_hold_the_character_back(tok, chat_prompt):
    detok = IncrementalDetokenizer(tok, chat_prompt)
    assert detok.add(tok.encode("ok") + GRINNING[:2]) == "ok"
    assert detok.add(GRINNING[2:]) == "\U0001F600"


def test_flush_drops_an_unfinished_character_instead_of_a_replacement_char(tok, chat_prompt):
    detok = IncrementalDetokenizer(tok, chat_prompt)
    assert detok.add(tok.encode("ok") + GRINNING[:2]) == "ok"
    assert detok.flush() == ""
    assert detok.text == "ok"


def test_flush_drops_a_cut_cjk_character_with_the_space_its_token_carried(tok, chat_prompt):
    detok = IncrementalDetokenizer(tok, chat_prompt)
    assert stream(detok, SPACE_NIHON[:3]) == ["", "", " 日"]
    assert (detok.flush(), detok.text) == ("", " 日")
    held = IncrementalDetokenizer(tok, chat_prompt)
    assert held.add(SPACE_NIHON[:1]) == ""  # " \ufffd": a space and half a character
    assert (held.flush(), held.text) == ("", "")


def test_a_genuine_replacement_char_mid_text_is_kept(tok, chat_prompt):
    ids = tok.encode("a\ufffdb")
    assert ids == [81, 24211, 82]
    detok = IncrementalDetokenizer(tok, chat_prompt)
    assert stream(detok, ids) == ["a", "", "\ufffdb"]
    assert (detok.flush(), detok.text) == ("", "a\ufffdb")


def test_a_genuine_replacement_char_as_the_last_character_goes_as_in_vllm(tok, chat_prompt):
    # vLLM holds back any text ending in U+FFFD and emits nothing at the end: a real one in
    # last place cannot be told from a cut character by decoding.
    detok = IncrementalDetokenizer(tok, chat_prompt)
    assert stream(detok, tok.encode("a\ufffd")) == ["a", ""]
    assert (detok.flush(), detok.text) == ("", "a")


def test_empty_prompt_is_allowed(tok):
    detok = IncrementalDetokenizer(tok, [])
    assert stream(detok, tok.encode("Hello world")) == ["Hello", " world"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_full_decode_for_every_fixture_string(
    tok, chat_prompt, skip_special_tokens
):
    mismatches = []
    for text in STRINGS:
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, chat_prompt, skip_special_tokens=skip_special_tokens)
        streamed = "".join(stream(detok, ids))
        held_back = detok.flush()
        if (streamed, held_back) != (tok.decode(ids, skip_special_tokens=skip_special_tokens), ""):
            mismatches.append(text)
    assert mismatches == []


def _window_only(tok: Tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(tok, "stream_decoder", lambda *args, **kwargs: None)


def _deltas(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool, sizes: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    out, at = [], 0
    for size in sizes:
        out.append(detok.add(ids[at : at + size]))
        at += size
    return out, detok.flush()


def _same_deltas_both_ways(tok: Tokenizer, cases, monkeypatch) -> list:
    streamed = [_deltas(tok, *case) for case in cases]
    with monkeypatch.context() as m:
        _window_only(tok, m)
        windowed = [_deltas(tok, *case) for case in cases]
    return [case for case, a, b in zip(cases, streamed, windowed, strict=True) if a != b]


def _random_cases(vocab: int, specials: list[int], count: int, seed: int) -> list:
    import random

    rng = random.Random(seed)
    cases = []
    for k in range(count):
        pick = lambda: rng.choice(specials) if specials and rng.random() < 0.05 else rng.randrange(vocab)  # noqa: E731
        prompt = [pick() for _ in range(rng.randrange(0, 9))]
        ids = [pick() for _ in range(rng.randrange(1, 40))]
        sizes, left = [], len(ids)
        while left:
            sizes.append(min(left, rng.choice([1, 1, 1, 2, 5])))
            left -= sizes[-1]
        cases.append((prompt, ids, k % 2 == 0, sizes))
    return cases


def test_the_backends_stream_gives_the_deltas_of_the_window_decode_on_random_ids(tok, monkeypatch):
    """Where tokenizers has DecodeStream each step runs there (module docstring): the deltas
    and the flush must be those of the window decode, token for token, specials included."""
    assert tok.stream_decoder([1, 2]) is not None  # the installed tokenizers has it: both paths run
    cases = _random_cases(tok.vocab_size, tok.all_special_ids, 400, seed=7)
    cases += [([], GRINNING + SPACE_NIHON, True, [1] * 7), ([5], GRINNING[:2], True, [2])]
    assert _same_deltas_both_ways(tok, cases, monkeypatch) == []


def test_a_byte_fallback_vocabulary_gives_the_same_deltas_both_ways(monkeypatch):
    """A Llama-2 style tokenizer (SentencePiece pieces, <0xNN> byte fallback, the decoder that
    strips the first space): its decoder rewrites byte runs, the case the stream hands back."""
    from tokenizers import Tokenizer as BackendTokenizer, decoders, models

    from engine.tokenizer.meta import TokenizerMeta

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [
        "▁", "▁the", "▁a", "b", "c", "▁日", "本", "é", "▁é", "ab", "▁c"]
    backend = BackendTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True,
                                          unk_token="<unk>"))
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(backend, TokenizerMeta(1, 2, frozenset({2}), None, ()))
    cases = _random_cases(len(pieces), [0, 1, 2], 400, seed=11)
    utf8 = [3 + b for b in "é日".encode()]  # whole characters as byte tokens, then cut ones
    cases += [([1], utf8, True, [1] * len(utf8)), ([], utf8[:-1] + [259], False, [1] * len(utf8))]
    assert _same_deltas_both_ways(tok, cases, monkeypatch) == []
