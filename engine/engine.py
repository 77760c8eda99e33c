"""LLMEngine: one loop over schedule -> execute -> update, plus text in and text out.

    add_request -> Scheduler.waiting -> step(): plan = scheduler.schedule()
                                                result = runner.execute(plan)
                                                core = scheduler.update(plan, result)
                                                outputs = output_processor.process(core)

n > 1: completion 0 runs first; the others wait until its prompt is computed and then
find the prompt's full blocks in the prefix cache, so the n completions share them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer: Tokenizer = self.core.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = self.core.eos_token_ids
        self._deferred: dict[str, list[Request]] = {}

    # The core's parts, for callers that inspect the engine (tests, metrics).
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def runner(self):
        return self.core.runner

    @property
    def spec(self):
        return self.core.spec

    @property
    def capacity(self):
        return self.core.capacity

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.core.model_path.stem

    # ------------------------------------------------------------------ intake
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
    ) -> None:
        """Queue a prompt (text or token ids). Raises ValueError if it can never run."""
        if isinstance(prompt, str):
            text, token_ids = prompt, tuple(self.tokenizer.encode(prompt))
        else:
            text, token_ids = None, tuple(int(t) for t in prompt)
        vocab = self.spec.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (0..{vocab - 1})")
        children = [
            Request(child_id, token_ids, params, self.eos_token_ids)
            for child_id in self.output_processor.add_request(request_id, text, token_ids, params)
        ]
        try:
            self.scheduler.add_request(children[0])
        except ValueError:
            self.output_processor.finish_aborted([c.request_id for c in children])
            raise
        if len(children) > 1:
            self._deferred[children[0].request_id] = children[1:]

    def abort_request(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """End requests (by the ids given to add_request) and free their blocks."""
        child_ids = []
        for request_id in request_ids:
            for child_id in self.output_processor.child_ids(request_id):
                child_ids.append(child_id)
                for deferred in self._deferred.pop(child_id, []):
                    child_ids.append(deferred.request_id)
        self.scheduler.abort(child_ids)
        return self.output_processor.finish_aborted(child_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._deferred)

    # -------------------------------------------------------------------- loop
    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        self._release_deferred()
        outputs, stopped = self.output_processor.process(core_outputs)
        for child_id, stop_string in stopped.items():
            request = self.scheduler.requests.get(child_id)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED, stop_string)
        return outputs

    def _release_deferred(self) -> None:
        """Admit siblings of n > 1 requests once the first one's prompt is computed."""
        for first_id in list(self._deferred):
            first = self.scheduler.requests.get(first_id)
            if first is None or first.num_computed_tokens >= first.num_prompt_tokens:
                for sibling in self._deferred.pop(first_id):
                    self.scheduler.add_request(sibling)

    # ------------------------------------------------------------------- state
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def num_used_blocks(self) -> int:
        return self.kv.num_blocks - self.kv.num_free_blocks
