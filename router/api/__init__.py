"""The front door: OpenAI-compatible HTTP and the public gRPC API, their guards, request validation and encoding."""
