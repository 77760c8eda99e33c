"""pdserve's front door: OpenAI-compatible HTTP (and later gRPC) over a GenerationBackend.

The router validates, templates and tokenizes requests, fans them out to a backend, and turns
the token deltas it gets back into text (incremental detokenization, stop strings), usage and
metrics. It imports no torch and no model code (a test checks it).
"""
