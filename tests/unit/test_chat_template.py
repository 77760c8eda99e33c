"""Chat templates: the default model's template against HF, and the Jinja environment's features."""

from __future__ import annotations

import jinja2
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from engine.loader.locate import default_model_path
from engine.tokenizer import Tokenizer
from engine.tokenizer.meta import TokenizerMeta

SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)
TWO_TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def with_template(template: str | None) -> Tokenizer:
    """A tokenizer with an empty vocabulary, for exercising templates alone."""
    meta = TokenizerMeta(
        bos_token_id=None,
        eos_token_id=None,
        stop_token_ids=frozenset(),
        chat_template=template,
        template_tokens=(("bos_token", "<s>"), ("eos_token", "</s>")),
    )
    return Tokenizer(BackendTokenizer(models.BPE()), meta)


def test_two_turn_prompt_equals_hf_apply_chat_template(tok, hf_tok):
    ours = tok.apply_chat_template(TWO_TURNS, add_generation_prompt=True)
    assert ours == hf_tok.apply_chat_template(TWO_TURNS, tokenize=False, add_generation_prompt=True)
    assert ours == (
        SYSTEM
        + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        + "<|im_start|>assistant\n4.<|im_end|>\n"
        + "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        + "<|im_start|>assistant\n"
    )


def test_prompt_without_generation_prompt_equals_hf(tok, hf_tok):
    messages = [{"role": "system", "content": "Be brief."}, *TWO_TURNS[:2]]
    ours = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
    )


def test_rendered_prompt_tokenizes_role_markers_as_special_ids(tok):
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    # <|im_start|>=1 and <|im_end|>=2 come out whole; "assistant" is "ass" + "istant".
    assert ids[:3] == [1, 9690, 198]
    assert ids[19:] == [2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]


def test_model_without_template_raises_value_error():
    tok = with_template(None)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_in_template_surfaces_as_template_error():
    tok = with_template(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(jinja2.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_tojson_keeps_non_ascii_and_html_characters():
    tok = with_template("{{ messages[0] | tojson }}")
    rendered = tok.apply_chat_template([{"role": "user", "content": "<b>é</b> & 😀"}])
    assert rendered == '{"role": "user", "content": "<b>é</b> & 😀"}'


def test_tojson_accepts_indent_and_sort_keys():
    tok = with_template("{{ tools | tojson(indent=1, sort_keys=True) }}")
    rendered = tok.apply_chat_template([], tools=[{"b": 1, "a": 2}])
    assert rendered == '[\n {\n  "a": 2,\n  "b": 1\n }\n]'


def test_strftime_now_formats_the_current_date():
    tok = with_template("{{ strftime_now('%Y') | length }}")
    assert tok.apply_chat_template([]) == "4"


def test_special_tokens_and_extra_kwargs_are_template_variables():
    tok = with_template("{{ bos_token }}{{ eos_token }}{% if enable_thinking %}T{% endif %}")
    assert tok.apply_chat_template([], enable_thinking=True) == "<s></s>T"
    assert tok.apply_chat_template([], bos_token="[B]") == "[B]</s>"


def test_blocks_are_trimmed_like_hf():
    template = "{% for m in messages %}\n  {{ m['content'] }}\n{% endfor %}"
    tok = with_template(template)
    assert tok.apply_chat_template([{"content": "a"}, {"content": "b"}]) == "  a\n  b\n"


def test_loop_controls_and_generation_tag_are_supported():
    template = (
        "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    tok = with_template(template)
    messages = [
        {"role": "user", "content": "a"},
        {"role": "skip", "content": "b"},
        {"role": "x", "content": "c"},
    ]
    assert tok.apply_chat_template(messages) == "ac"


def test_sandbox_blocks_access_to_python_internals():
    tok = with_template("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])


def test_add_generation_prompt_defaults_to_true():
    tok = with_template("{% if add_generation_prompt %}GEN{% endif %}")
    assert tok.apply_chat_template([]) == "GEN"
    assert tok.apply_chat_template([], add_generation_prompt=False) == ""
