"""Rendering a model's own Jinja chat template, the way HF transformers renders it.

Templates come with model files and are untrusted code, so they run in jinja2's immutable sandbox.
The environment matches transformers' `apply_chat_template`: `trim_blocks` and `lstrip_blocks`,
the `loopcontrols` extension, a `tojson` filter that does not HTML-escape, and the globals
`raise_exception(message)` and `strftime_now(format)`. Transformers' `{% generation %}` tag is
accepted and renders its body unchanged (we never ask for assistant masks).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>` and `&`, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile `source` in the sandbox; cached, as a process renders the same template repeatedly.

    Raises jinja2.TemplateSyntaxError for a malformed template.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    special_tokens: dict[str, str],
    **kwargs: Any,
) -> str:
    """Render `source` for one conversation; pure apart from `strftime_now`.

    `special_tokens` (e.g. {"bos_token": "<s>"}) are visible to the template like in HF; `kwargs`
    override them and pass any extra variable a template reads (e.g. `enable_thinking`).
    Raises jinja2.TemplateError when the template calls `raise_exception` or fails to render.
    """
    template = compile_chat_template(source)
    # HF always defines `documents` (None unless given); some templates test it.
    context = {**special_tokens, "documents": None, **kwargs}
    return template.render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
    )
