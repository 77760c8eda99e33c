"""Conversions between the protobuf messages and the engine's plain types (both ways)."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from proto.pdserve.v1 import common_pb2


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output, ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens, skip_special_tokens=p.skip_special_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (SamplingParams' validation) on bad values."""
    return SamplingParams(
        n=msg.n or 1, temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
        min_p=msg.min_p, seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0, stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output, ignore_eos=msg.ignore_eos,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        min_tokens=msg.min_tokens,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
    )


def logprobs_to_proto(lp) -> common_pb2.TokenLogprobs:
    """From any object with token_id, logprob, rank, top ((id, logprob), ...)."""
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )
