"""Request bodies of the OpenAI-compatible API, with vLLM's field names and defaults.

Unknown fields are accepted and ignored, as vLLM and OpenAI do. Fields the router cannot honour
(beam search, logit bias, ...) are declared so that validation can refuse them with a 400
instead of silently ignoring them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
Int32 = Annotated[int, Field(ge=_INT32_MIN, le=_INT32_MAX)]
"""Every integer that ends up in an int32/uint32 field of the internal protos is bounded here,
so an accepted request always fits the messages it causes (negative values are refused later
with vLLM's own messages, by SamplingParams)."""
NonNegativeInt = Annotated[int, Field(ge=0, le=_INT32_MAX)]


class OpenAIBaseModel(BaseModel):
    # OpenAI's API tolerates extra fields; so does vLLM.
    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="after")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        # JSON may spell a lone UTF-16 surrogate ("\ud800"); Python keeps it in the str, and
        # the tokenizer (or any UTF-8 encode) would fail much later with a 500.
        if _has_lone_surrogate(value):
            raise ValueError("text must be valid Unicode: it holds a lone surrogate (e.g. \\ud800)")
        return value


def _has_lone_surrogate(value: object) -> bool:
    """True if a str in `value` (or in its lists and dict values) cannot be encoded as UTF-8.
    Nested models check themselves."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]


class SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by completions and chat completions (vLLM's extras included)."""

    model: str | None = None
    n: Int32 | None = 1
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = []
    stop_token_ids: list[Int32] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    user: str | None = None
    # Declared to be refused (see validation.refuse_unsupported).
    logit_bias: dict[str, float] | None = None
    use_beam_search: bool = False
    prompt_logprobs: Int32 | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: list[NonNegativeInt] | list[list[NonNegativeInt]] | str | list[str] | None = None
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool = True


class TextContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatTemplateFields(OpenAIBaseModel):
    """How a conversation becomes a prompt (shared by chat completions and /tokenize)."""

    messages: list[ChatMessage]
    tools: list[ChatCompletionTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """POST /v1/chat/completions."""

    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = False
    top_logprobs: Int32 | None = 0
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "none"
    parallel_tool_calls: bool | None = True
    echo: bool = False


class TokenizeCompletionRequest(OpenAIBaseModel):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateFields):
    """POST /tokenize with chat messages."""

    model: str | None = None
    return_token_strs: bool | None = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[NonNegativeInt]
