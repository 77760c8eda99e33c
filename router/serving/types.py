"""Plain values the router shares with its backends (pure: no tokenizer, no I/O).

TokenLogprobs is the engine's own type (engine.outputs is pure), so workers, the cluster
backend and the HTTP layer all speak the same one.
"""

from engine.outputs import TokenLogprobs

__all__ = ["TokenLogprobs"]
