"""Offline API: `LLM(model=None, dtype="auto", **engine_args).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Runs the engine loop in this process until every prompt is done.

    Example:
        llm = LLM(dtype="float32")
        [out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
        print(out.text)
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_args: object) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype=dtype, **engine_args))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        llm._ids = itertools.count()
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = self._params_for(len(prompts), sampling_params)
        ids = []
        for prompt, params in zip(prompts, params_list, strict=True):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, prompt, params)
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.tokenizer.encode(self.tokenizer.apply_chat_template(c, add_generation_prompt=True),
                                  add_special_tokens=False)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)

    @staticmethod
    def _params_for(count: int, params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return list(params)
