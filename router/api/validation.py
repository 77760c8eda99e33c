"""From a decoded OpenAI request to token ids and SamplingParams, or an InvalidRequest.

Pure apart from the tokenizer: no I/O, no backend. Messages copy vLLM's where vLLM has one
(context length, stream options, logprobs), so clients that parse them keep working.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.errors import InvalidRequest, ModelNotFound
from router.api.openai_models import (
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    SamplingFields,
)


@dataclass(frozen=True)
class Prompt:
    """One prompt as the backend will see it."""

    token_ids: tuple[int, ...]
    text: str | None
    """The prompt's text (for echo); None when the client sent token ids."""


DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024
"""2 MiB of HTTP body or gRPC message: a whole max_model_len prompt, as text or as token ids,
takes a small fraction of it, and tokenizing 2 MiB stays well under a second."""


@dataclass(frozen=True)
class RequestLimits:
    """Bounds checked before any work (tokenizing, routing), so one request cannot take the
    router's memory or time from the others, and an accepted request fits the internal messages."""

    max_n: int = 128
    """Most completions per prompt (`n`). OpenAI's own cap; each one is a separate sequence
    with its own KV blocks, so n=1,000,000 must be refused before it is fanned out."""
    max_sequences: int = 1024
    """Most sequences per request: prompts x n (a batch of prompts multiplies n)."""
    max_stop: int = 64
    """Most stop strings per request; each is matched against every new token's text."""
    max_stop_chars: int = 1024
    """Longest stop string, in characters."""
    max_stop_token_ids: int = 1024
    """Most stop token ids per request."""

    def __post_init__(self) -> None:
        for name in ("max_n", "max_sequences", "max_stop", "max_stop_chars", "max_stop_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def check_limits(req: SamplingFields, num_prompts: int, limits: RequestLimits) -> None:
    """Raises InvalidRequest, naming the field, when `req` exceeds `limits` (cheap: counts only)."""
    n = 1 if req.n is None else req.n
    if n > limits.max_n:
        raise InvalidRequest(f"n must be at most {limits.max_n}, got {n}.", param="n")
    if num_prompts * n > limits.max_sequences:
        raise InvalidRequest(
            f"This request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); "
            f"at most {limits.max_sequences} are allowed per request.",
            param="n",
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    if len(stop) > limits.max_stop:
        raise InvalidRequest(
            f"stop may hold at most {limits.max_stop} strings, got {len(stop)}.", param="stop"
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_chars:
        raise InvalidRequest(
            f"each stop string may be at most {limits.max_stop_chars} characters, got one of "
            f"{longest}.",
            param="stop",
        )
    ids = req.stop_token_ids or ()
    if len(ids) > limits.max_stop_token_ids:
        raise InvalidRequest(
            f"stop_token_ids may hold at most {limits.max_stop_token_ids} ids, got {len(ids)}.",
            param="stop_token_ids",
        )


def num_completion_prompts(req: CompletionRequest) -> int:
    """How many prompts a completion request holds (before tokenizing)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1


def check_model(requested: str | None, served: str) -> None:
    """Raises ModelNotFound unless `requested` is the served model (or omitted)."""
    if requested is not None and requested != served:
        raise ModelNotFound(requested)


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """Raises InvalidRequest, with vLLM's (v0.11) message, when prompt + completion cannot fit."""
    if max_tokens is None:
        if prompt_len >= max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the input "
                "messages.",
                param="messages",
            )
        return
    if prompt_len + max_tokens > max_model_len:
        raise InvalidRequest(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has {prompt_len} "
            f"input tokens ({max_tokens} > {max_model_len} - {prompt_len}).",
            param="max_tokens",
        )


def refuse_unsupported(req: SamplingFields) -> None:
    """Raises InvalidRequest for fields the router cannot honour (rather than ignoring them)."""
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    if req.use_beam_search:
        raise InvalidRequest("beam search is not supported", param="use_beam_search")
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported", param="logit_bias")
    if req.prompt_logprobs is not None:
        raise InvalidRequest("prompt_logprobs is not supported", param="prompt_logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise InvalidRequest(
            f"response_format {req.response_format.type!r} is not supported",
            param="response_format",
        )


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """SamplingParams for `req` (n as requested); its ValueError becomes InvalidRequest."""
    try:
        return SamplingParams(
            n=1 if req.n is None else req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer,
                       encoded: Mapping[str, Sequence[int]] | None = None) -> tuple[Prompt, ...]:
    """The request's prompts, tokenized (`encoded`: texts already tokenized, with the request's
    add_special_tokens); raises InvalidRequest for an empty or bad prompt."""
    prompt = req.prompt
    if prompt is None or prompt == "" or prompt == []:
        raise InvalidRequest(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif all(isinstance(p, int) for p in prompt):
        items = [prompt]  # type: ignore[list-item]  # one prompt given as token ids
    else:
        items = list(prompt)  # type: ignore[arg-type]
    return tuple(_one_prompt(item, tokenizer, req.add_special_tokens, encoded or {}) for item in items)


def _one_prompt(item: str | list[int], tokenizer: Tokenizer, add_special: bool,
                encoded: Mapping[str, Sequence[int]]) -> Prompt:
    if isinstance(item, str):
        ids = encoded.get(item)
        return checked_prompt(tokenizer.encode(item, add_special_tokens=add_special) if ids is None else ids,
                              item, tokenizer)
    return checked_prompt(item, None, tokenizer)


def checked_prompt(ids: Sequence[int], text: str | None, tokenizer: Tokenizer) -> Prompt:
    """A prompt of `ids` (of `text`); raises InvalidRequest for no ids or one outside the vocabulary."""
    ids = tuple(ids)
    check_token_ids(ids, tokenizer)
    return Prompt(token_ids=ids, text=text)


def check_token_ids(ids: tuple[int, ...], tokenizer: Tokenizer) -> None:
    """Raises InvalidRequest for an empty prompt or an id outside the vocabulary."""
    if not ids:
        raise InvalidRequest("The decoder prompt cannot be empty", param="prompt")
    if max(ids) >= tokenizer.vocab_size:
        raise InvalidRequest(f"Token id {max(ids)} is out of vocabulary", param="prompt")


def completion_logprobs(req: CompletionRequest) -> int | None:
    """The per-token top-k the completion asks for; refuses what cannot be served."""
    if req.suffix is not None:
        raise InvalidRequest("suffix is not currently supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise InvalidRequest(
            "echo with logprobs is not supported (it needs prompt logprobs)", param="echo"
        )
    return req.logprobs


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """The per-token top-k the chat request asks for (None = no logprobs), as vLLM checks it."""
    top = req.top_logprobs
    if top is not None and top < 0:
        raise InvalidRequest("`top_logprobs` must be a positive value.", param="top_logprobs")
    if top and not req.logprobs:
        raise InvalidRequest(
            "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
        )
    return (top or 0) if req.logprobs else None


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    """max_completion_tokens, else max_tokens (deprecated), else None."""
    return req.max_completion_tokens or req.max_tokens


def check_chat_options(req: ChatCompletionRequest) -> None:
    """Raises InvalidRequest for chat options the router does not implement."""
    if not req.messages:
        raise InvalidRequest(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got "
            "an empty array instead.",
            param="messages",
        )
    if req.echo:
        raise InvalidRequest("echo is not supported for chat completions", param="echo")
    check_tool_choice(req)


AUTO_TOOL_CHOICE_REFUSED = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
"""vLLM's exact words (clients match them to fall back to plain chat); pdserve then says why."""


def effective_tool_choice(req: ChatCompletionRequest) -> Any:
    """tool_choice as vLLM reads it: "auto" when tools are sent without one, "none" when
    "required" comes with an empty tools list (OpenAI's behaviour)."""
    if "tool_choice" not in req.model_fields_set:
        return "auto" if req.tools else "none"
    if req.tool_choice == "required" and req.tools == []:
        return "none"
    return req.tool_choice


def check_tool_choice(req: ChatCompletionRequest) -> None:
    """Refuses, as vLLM does without a tool-call parser, every request that asks for tool calls:
    a 200 that silently ignored the tools would look like a model that never calls them.
    tool_choice "none" (tools only shown to the template) is served."""
    choice = effective_tool_choice(req)
    if choice is None or choice == "none":
        return
    if req.tools is None:
        raise InvalidRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        raise InvalidRequest(
            f"{AUTO_TOOL_CHOICE_REFUSED} (pdserve has no tool-call parser yet: leave out `tools`, "
            'or send tool_choice "none")',
            param="tool_choice",
        )
    if choice != "required":
        _check_named_tool(choice.function, req.tools)
    raise InvalidRequest(
        'tool_choice "required" or a named function needs structured outputs to force the '
        'call, which pdserve does not have yet: leave out `tools`, or send tool_choice "none"',
        param="tool_choice",
    )


def _check_named_tool(function: dict[str, Any], tools: list) -> None:
    """vLLM's checks of a named tool_choice, with its messages."""
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    name = function.get("name")
    if "name" not in function:
        raise InvalidRequest(
            f"Expected field `name` in `function` in `tool_choice`! {usage}", param="tool_choice"
        )
    if not isinstance(name, str) or not name:
        raise InvalidRequest(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
            param="tool_choice",
        )
    if all(tool.function.name != name for tool in tools):
        raise InvalidRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )


def chat_prompt(req: ChatTemplateFields, tokenizer: Tokenizer) -> Prompt:
    """Render the conversation with the model's template and tokenize it."""
    text = chat_text(req, tokenizer)
    return checked_prompt(tokenizer.encode(text, add_special_tokens=req.add_special_tokens), text, tokenizer)


def chat_text(req: ChatTemplateFields, tokenizer: Tokenizer) -> str:
    """The conversation rendered with the model's template; raises InvalidRequest."""
    if req.chat_template is not None:
        raise InvalidRequest(
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
            param="chat_template",
        )
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    messages = [_message_dict(m) for m in req.messages]
    return _render(req, messages, tokenizer)


def _render(req: ChatTemplateFields, messages: list[dict[str, Any]], tok: Tokenizer) -> str:
    tools = None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]
    kwargs = dict(req.chat_template_kwargs or {})
    if req.documents is not None:
        kwargs["documents"] = req.documents
    try:
        text = tok.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tools=tools, **kwargs
        )
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise InvalidRequest(str(exc), param="messages") from exc
    if req.continue_final_message:
        # As in transformers: cut the prompt right after the final message's content, so the
        # model continues that message instead of closing it.
        final = messages[-1].get("content") or ""
        cut = text.rfind(final.strip()) if final.strip() else -1
        if cut < 0:
            raise InvalidRequest("continue_final_message: final message not found in prompt")
        text = text[: cut + len(final.strip())]
    return text


def _message_dict(message: Any) -> dict[str, Any]:
    """A message as chat templates expect it: content flattened to one string."""
    out = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"content part type {part.type!r} is not supported: this model reads text "
                    "only",
                    param="messages",
                )
            texts.append(part.text)
        out["content"] = "\n".join(texts)
    return out
