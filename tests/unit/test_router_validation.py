"""Request validation: prompts, context length, sampling params, refused options."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from router.errors import InvalidRequest, ModelNotFound
from router.api.openai_models import ChatCompletionRequest, CompletionRequest
from router.api.validation import (
    Prompt,
    chat_logprobs,
    chat_prompt,
    check_chat_options,
    check_context_length,
    check_model,
    completion_logprobs,
    completion_prompts,
    refuse_unsupported,
    sampling_params,
)
from tests.unit.router_doubles import smollm2_tokenizer

USER_HI = [{"role": "user", "content": "Hi"}]
# SmolLM2's template with its default system prompt, then "Hi" and the assistant header.
HI_PROMPT_IDS = (
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198,
)  # fmt: skip


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(**{"prompt": "Hello", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": USER_HI, **fields})


def invalid(fn, *args) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        fn(*args)
    return info.value


def test_context_length_error_has_vllms_exact_message():
    error = invalid(check_context_length, 10, 2040, 2048)
    assert error.message == (
        "'max_tokens' or 'max_completion_tokens' is too large: 2040. This model's maximum "
        "context length is 2048 tokens and your request has 10 input tokens (2040 > 2048 - 10)."
    )
    assert error.param == "max_tokens"


def test_prompt_filling_the_context_without_max_tokens_is_refused_with_vllms_message():
    assert invalid(check_context_length, 2048, None, 2048).message == (
        "This model's maximum context length is 2048 tokens. However, your request has 2048 "
        "input tokens. Please reduce the length of the input messages."
    )


def test_prompt_and_completion_that_exactly_fill_the_context_pass():
    check_context_length(2000, 48, 2048)
    check_context_length(2047, None, 2048)


def test_unknown_model_is_not_found_and_an_omitted_model_is_the_served_one():
    check_model(None, "SmolLM2-135M-Instruct")
    check_model("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct")
    with pytest.raises(ModelNotFound, match="The model `llama` does not exist."):
        check_model("llama", "SmolLM2-135M-Instruct")


def test_each_prompt_form_becomes_token_ids():
    tok = smollm2_tokenizer()
    assert completion_prompts(completion(prompt="Hello"), tok) == (Prompt((19556,), "Hello"),)
    assert completion_prompts(completion(prompt=["Hello", "Hi"]), tok) == (
        Prompt((19556,), "Hello"),
        Prompt((26843,), "Hi"),
    )
    assert completion_prompts(completion(prompt=[19556, 26843]), tok) == (
        Prompt((19556, 26843), None),
    )
    assert completion_prompts(completion(prompt=[[19556], [26843]]), tok) == (
        Prompt((19556,), None),
        Prompt((26843,), None),
    )


def test_empty_or_out_of_vocabulary_prompts_are_refused():
    tok = smollm2_tokenizer()
    assert invalid(completion_prompts, completion(prompt=""), tok).message == (
        "Either prompt or prompt_embeds must be provided and non-empty."
    )
    assert invalid(completion_prompts, completion(prompt=[[]]), tok).message == (
        "The decoder prompt cannot be empty"
    )
    assert invalid(completion_prompts, completion(prompt=[49152]), tok).message == (
        "Token id 49152 is out of vocabulary"
    )


def test_request_fields_become_sampling_params():
    req = completion(
        n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, stop="\n",
        stop_token_ids=[2], presence_penalty=0.5, frequency_penalty=0.25,
        repetition_penalty=1.1, ignore_eos=True, min_tokens=2, skip_special_tokens=False,
        include_stop_str_in_output=True,
    )  # fmt: skip
    assert sampling_params(req, max_tokens=32, logprobs=3) == SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, stop=("\n",),
        stop_token_ids=(2,), presence_penalty=0.5, frequency_penalty=0.25,
        repetition_penalty=1.1, ignore_eos=True, min_tokens=2, skip_special_tokens=False,
        include_stop_str_in_output=True, max_tokens=32, logprobs=3,
    )  # fmt: skip


def test_unset_sampling_fields_take_openai_defaults():
    assert sampling_params(completion(), max_tokens=16, logprobs=None) == SamplingParams(
        max_tokens=16
    )


def test_negative_temperature_is_refused_with_the_sampling_params_message():
    error = invalid(sampling_params, completion(temperature=-1), 16, None)
    assert error.message == "temperature must be non-negative, got -1.0."


def test_too_many_logprobs_are_refused_with_vllms_message():
    error = invalid(sampling_params, completion(logprobs=21), 16, 21)
    assert error.message == "Requested sample logprobs of 21, which is greater than max allowed: 20"


def test_stream_options_without_stream_are_refused():
    error = invalid(refuse_unsupported, completion(stream_options={"include_usage": True}))
    assert error.message == "Stream options can only be defined when `stream=True`."


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_beam_search": True}, "beam search is not supported"),
        ({"logit_bias": {"50256": -100}}, "logit_bias is not supported"),
        ({"prompt_logprobs": 1}, "prompt_logprobs is not supported"),
        ({"response_format": {"type": "json_object"}},
         "response_format 'json_object' is not supported"),
    ],
)  # fmt: skip
def test_options_the_router_cannot_honour_are_refused(fields, message):
    assert invalid(refuse_unsupported, completion(**fields)).message == message


def test_completion_suffix_and_echo_with_logprobs_are_refused():
    assert invalid(completion_logprobs, completion(suffix="x")).message == (
        "suffix is not currently supported"
    )
    assert invalid(completion_logprobs, completion(echo=True, logprobs=1)).message == (
        "echo with logprobs is not supported (it needs prompt logprobs)"
    )


def test_chat_logprobs_follow_logprobs_and_top_logprobs():
    assert chat_logprobs(chat()) is None
    assert chat_logprobs(chat(logprobs=True)) == 0
    assert chat_logprobs(chat(logprobs=True, top_logprobs=5)) == 5
    assert invalid(chat_logprobs, chat(top_logprobs=2)).message == (
        "when using `top_logprobs`, `logprobs` must be set to true."
    )


def test_chat_prompt_renders_the_models_template():
    prompt = chat_prompt(chat(), smollm2_tokenizer())
    assert prompt.token_ids == HI_PROMPT_IDS
    assert prompt.text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_chat_text_content_parts_are_joined_like_a_string():
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert chat_prompt(chat(messages=parts), smollm2_tokenizer()).token_ids == HI_PROMPT_IDS


def test_chat_image_content_is_refused():
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    error = invalid(chat_prompt, chat(messages=image), smollm2_tokenizer())
    assert error.message == (
        "content part type 'image_url' is not supported: this model reads text only"
    )


def test_a_chat_template_sent_with_the_request_is_refused():
    error = invalid(chat_prompt, chat(chat_template="{{ messages }}"), smollm2_tokenizer())
    assert error.message.startswith("Chat template is passed with request, but")


def test_continue_final_message_leaves_the_assistant_turn_open():
    messages = [*USER_HI, {"role": "assistant", "content": "Hello! How"}]
    req = chat(messages=messages, add_generation_prompt=False, continue_final_message=True)
    prompt = chat_prompt(req, smollm2_tokenizer())
    assert prompt.text.endswith("<|im_start|>assistant\nHello! How")


def test_required_tool_choice_is_refused_and_none_is_accepted():
    check_chat_options(chat(tool_choice="none"))
    check_chat_options(chat())
    assert invalid(check_chat_options, chat(tool_choice="required")).param == "tool_choice"
