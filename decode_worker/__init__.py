"""Decode worker: admits requests by reserving blocks, receives their KV, decodes."""
