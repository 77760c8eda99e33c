"""One choice's output: token deltas in, text (detokenized, stop strings applied) out.

Tokens are fed one at a time, so a stop string ends the choice at the exact token that
completed it; tokens after it in the same delta are dropped. As in vLLM, the token that stopped
generation (EOS or a stop token id) is counted and returned in token_ids but not detokenized,
unless include_stop_str_in_output.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from router.serving.backend import TokenDelta
from router.serving.results import Choice, ChoiceUpdate, Logprob, PositionLogprobs
from router.serving.types import TokenLogprobs


class ChoiceTracker:
    """Accumulates one backend request's output. Not thread-safe; one per choice."""

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        echo_text: str = "",
    ) -> None:
        self.index = index
        self._tokenizer = tokenizer
        self._params = params
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        self._matcher = (
            StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None
        )
        self._pending_echo = echo_text
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[PositionLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stopped_by_string = False
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    def apply(self, delta: TokenDelta) -> ChoiceUpdate:
        """Consume `delta`; return what the client gets for it. Mutates this tracker."""
        assert not self.finished, f"choice {self.index} got a delta after it finished"
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        pieces, ids, lps = [self._pending_echo], [], []
        self._pending_echo = ""
        for k, token_id in enumerate(delta.token_ids):
            ids.append(token_id)
            if delta.logprobs:
                lps.append(self._decode_logprobs(delta.logprobs[k]))
            if self._is_unprinted_stop_token(delta, k):
                continue
            text, matched = self._feed(self._detok.add([token_id]))
            pieces.append(text)
            if matched is not None:
                self.finish_reason, self.stop_reason = "stop", matched
                self.stopped_by_string = True
                break
        if not self.finished and delta.finish_reason is not None:
            pieces.append(self._finish(delta))
        return self._record("".join(pieces), ids, lps)

    def result(self) -> Choice:
        """The choice as it stands (finish_reason None if it never finished)."""
        return Choice(
            index=self.index,
            text="".join(self._text),
            token_ids=tuple(self._token_ids),
            logprobs=tuple(self._logprobs) if self._params.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def _record(self, text: str, ids: list[int], lps: list[PositionLogprobs]) -> ChoiceUpdate:
        self._text.append(text)
        self._token_ids += ids
        self._logprobs += lps
        return ChoiceUpdate(
            index=self.index,
            text=text,
            token_ids=tuple(ids),
            logprobs=tuple(lps) if self._params.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def _is_unprinted_stop_token(self, delta: TokenDelta, k: int) -> bool:
        return (
            delta.finish_reason == "stop"
            and delta.stop_token_id is not None
            and k == len(delta.token_ids) - 1
            and not self._params.include_stop_str_in_output
        )

    def _feed(self, text: str) -> tuple[str, str | None]:
        if self._matcher is None:
            return text, None
        check = self._matcher.feed(text)
        return check.text, check.matched

    def _finish(self, delta: TokenDelta) -> str:
        """Text still held back when the backend ends the choice (EOS, stop token, length)."""
        tail, matched = self._feed(self._detok.flush())
        if matched is not None:
            self.finish_reason, self.stop_reason = "stop", matched
            self.stopped_by_string = True
            return tail
        if self._matcher is not None:
            tail += self._matcher.flush()
        self.finish_reason = delta.finish_reason
        user_stop = delta.stop_token_id in self._params.stop_token_ids
        self.stop_reason = delta.stop_token_id if user_stop else None
        return tail

    def _decode_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        k = self._params.logprobs or 0
        return PositionLogprobs(
            sampled=self._logprob(lp.token_id, lp.logprob),
            top=tuple(self._logprob(tid, value) for tid, value in lp.top[:k]),
        )

    def _logprob(self, token_id: int, value: float) -> Logprob:
        # vLLM reports each token's own text, special tokens spelled out.
        token = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return Logprob(token_id=token_id, token=token, logprob=value)
