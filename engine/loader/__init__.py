"""Model loading: GGUF files and HF folders (see model_loader.load_model).

Kept free of torch at import time: the router reads GGUF metadata (tokenizer) through
`engine.loader.gguf_meta` without loading torch.
"""
