"""pdserve's engine core: shared by prefill and decode workers and the offline `LLM`.

`LLM` and `LLMEngine` are imported lazily so that the pure parts (kv_cache, scheduler,
request, sampling params) can be imported without loading torch's model code.
"""

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
