"""Tokenization: text <-> ids, chat prompts, streaming detokenization, stop strings."""

from engine.tokenizer.detokenizer import IncrementalDetokenizer
from engine.tokenizer.stop import StopStringMatcher
from engine.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "Tokenizer", "load_tokenizer"]
