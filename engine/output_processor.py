"""Turns the engine core's token outputs into text, applies stop strings, groups n > 1.

Stop strings are text, so they are found here, after detokenization; the engine then
ends the request in the scheduler (as vLLM does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclass
class _Completion:
    """One of a request's n completions (one engine-core request)."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def snapshot(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=tuple(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    completions: list[_Completion]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def snapshot(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=tuple(c.snapshot() for c in self.completions),
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """Engine-core id of completion `index` (the parent id itself when n == 1)."""
    return parent_id if n == 1 else f"{index}_{parent_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Completion]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: tuple[int, ...], params: SamplingParams
    ) -> list[str]:
        """Track a request; returns the engine-core ids of its n completions."""
        parent = _Parent(request_id, prompt, prompt_token_ids, [])
        child_ids = []
        for index in range(params.n):
            completion = _Completion(
                index=index,
                params=params,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, list(prompt_token_ids), skip_special_tokens=params.skip_special_tokens
                ),
                matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None,
                logprobs=[] if params.logprobs is not None else None,
            )
            parent.completions.append(completion)
            child_id = child_request_id(request_id, index, params.n)
            self._children[child_id] = (parent, completion)
            child_ids.append(child_id)
        self._parents[request_id] = parent
        return child_ids

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        n = len(parent.completions)
        return [child_request_id(request_id, i, n) for i in range(n)]

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], dict[str, str]]:
        """Apply new tokens. Returns updated requests and {child id: stop string} for
        completions a stop string ended (the caller must end them in the scheduler)."""
        touched: dict[str, _Parent] = {}
        stopped: dict[str, str] = {}
        for out in core_outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                continue
            parent, completion = entry
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            stop_string = self._apply(completion, out)
            if stop_string is not None:
                stopped[out.request_id] = stop_string
            if completion.finish_reason is not None:
                del self._children[out.request_id]
            touched[parent.request_id] = parent
        return self._emit(touched), stopped

    def finish_aborted(self, child_ids: list[str]) -> list[RequestOutput]:
        """Mark completions ended by abort (client gone, engine shutting down)."""
        touched: dict[str, _Parent] = {}
        for child_id in child_ids:
            entry = self._children.pop(child_id, None)
            if entry is None:
                continue
            parent, completion = entry
            completion.finish_reason = "abort"
            touched[parent.request_id] = parent
        return self._emit(touched)

    def _emit(self, touched: dict[str, _Parent]) -> list[RequestOutput]:
        outputs = []
        for parent in touched.values():
            outputs.append(parent.snapshot())
            if parent.finished:
                self._parents.pop(parent.request_id, None)
        return outputs

    def _apply(self, completion: _Completion, out: EngineCoreOutput) -> str | None:
        completion.token_ids.extend(out.new_token_ids)
        if out.logprobs is not None and completion.logprobs is not None:
            completion.logprobs.append(self._logprob_dict(out.logprobs))
            completion.cumulative_logprob += out.logprobs.logprob
        finished = out.finish_reason is not None
        delta = completion.detokenizer.add(list(out.new_token_ids))
        if finished:
            delta += completion.detokenizer.flush()
        stop_string = None
        # vLLM looks for stop strings only once min_tokens have been generated.
        if completion.matcher is not None and len(completion.token_ids) > completion.params.min_tokens:
            check = completion.matcher.feed(delta)
            delta, stop_string = check.text, check.matched
            if stop_string is None and finished:
                delta += completion.matcher.flush()
        completion.text += delta
        if stop_string is not None:
            completion.finish_reason, completion.stop_reason = "stop", stop_string
        elif finished:
            completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
        return stop_string

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        # The sampled token first, then the top alternatives (vLLM's order).
        decode = self.tokenizer.decode
        entries = {lp.token_id: Logprob(lp.logprob, lp.rank, decode([lp.token_id], skip_special_tokens=False))}
        for rank, (token_id, value) in enumerate(lp.top, start=1):
            entries.setdefault(token_id, Logprob(value, rank, decode([token_id], skip_special_tokens=False)))
        return entries
