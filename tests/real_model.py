"""The real default model (SmolLM2-135M-Instruct GGUF) and its HF transformers reference.

HF transformers loads the same GGUF file independently (its own dequantizer, tokenizer
and Llama code), which makes it the reference for token-exact checks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.loader.locate import default_model_path

NUM_NEW_TOKENS = 48

_DOCUMENT = (
    "The Rhine is a river that begins in the Swiss canton of Graubünden in the southeastern "
    "Swiss Alps. It forms part of the Swiss-Liechtenstein, Swiss-Austrian and Swiss-German "
    "borders, and then the Franco-German border, then flows through the German Rhineland and "
    "the Netherlands and eventually empties into the North Sea. It is the second-longest river "
    "in Central and Western Europe, after the Danube, at about 1,230 km, with an average "
    "discharge of about 2,900 m3/s. The Rhine and the Danube comprised much of the northern "
    "inland frontier of the Roman Empire, and since those days the Rhine has been a vital "
    "navigable waterway carrying trade and goods deep inland."
)

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 5, 8, 13,",
    "import numpy as np\nimport torch\n\nclass",
    "The quick brown fox",
    "Translate to French: I love cheese. ->",
    "Q: What is 17 * 23?\nA:",
    "<html>\n  <head>\n    <title>",
    "Les mots français avec des accents: é, è, à, ç, et",
    "SELECT name, COUNT(*) FROM users",
    "Emoji story: 🐱🐶🐭 The cat",
    "    \t  whitespace   runs\n\n\nand then",
    "Ein kurzer deutscher Satz über das Wetter:",
    "In mathematics, a prime number is",
]
CHAT_QUESTIONS = [
    "What is the capital of Japan?",
    "Write a haiku about autumn.",
    "Explain recursion in one sentence.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "What is 2 + 2?",
    "Give me a synonym for happy.",
]
DOC_QUESTIONS = [
    "Where does the Rhine begin?",
    "How long is the Rhine?",
    "Which sea does the Rhine flow into?",
    "Which river is longer than the Rhine?",
    "What frontier did the Rhine form?",
    "Summarise the text in one sentence.",
    "Name two countries the Rhine flows through.",
    "What is the average discharge of the Rhine?",
]


def model_dir_and_file() -> tuple[str, str]:
    path = default_model_path()
    return str(path.parent), path.name


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer

    folder, name = model_dir_and_file()
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _chat_ids(question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    text = hf_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_tokenizer()(text, add_special_tokens=False)["input_ids"]


@functools.cache
def prompt_token_ids() -> tuple[tuple[int, ...], ...]:
    """30 varied prompts as token ids: raw text, chats, and chats sharing a long document."""
    tok = hf_tokenizer()
    raw = [tok(p, add_special_tokens=False)["input_ids"] for p in RAW_PROMPTS]
    chats = [_chat_ids(q) for q in CHAT_QUESTIONS]
    doc = [_chat_ids(q, system="Answer from this text.\n\n" + _DOCUMENT) for q in DOC_QUESTIONS]
    return tuple(tuple(ids) for ids in raw + chats + doc)


@dataclass(frozen=True)
class Reference:
    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[torch.Tensor, ...]  # per prompt: [NUM_NEW_TOKENS, vocab] log_softmax of logits


@functools.cache
def hf_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    folder, name = model_dir_and_file()
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()


@functools.cache
def hf_reference(dtype: torch.dtype = torch.float32, every: int = 1) -> Reference:
    """Greedy HF generate, one prompt at a time, eos not stopping (ignore_eos), for every
    `every`-th prompt of prompt_token_ids() (all by default)."""
    model = hf_model(dtype)
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in prompt_token_ids()[::every]:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens.append(tuple(out.sequences[0, len(ids):].tolist()))
            logprobs.append(torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
    return Reference(tuple(tokens), tuple(logprobs))
