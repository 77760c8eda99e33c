"""The dequantized-weights cache: a GGUF's second load reads float32 safetensors keyed by
the file's sha256; a torn or foreign cache file is ignored and rewritten."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from engine.loader import weights_cache
from engine.loader.model_loader import load_model

CPU = torch.device("cpu")
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 256
_LAYER_SHAPES = {
    "attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
    "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
    "ffn_down": (HIDDEN, INTERMEDIATE), "attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,),
}


def write_tiny_gguf(path: Path, seed: int = 0, tied: bool = False) -> Path:
    """A tiny llama GGUF with Q8_0 matrices and F32 norms."""
    rng = np.random.default_rng(seed)
    tensors = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        tensors["output.weight"] = (VOCAB, HIDDEN)
    for layer in range(LAYERS):
        tensors.update({f"blk.{layer}.{name}.weight": shape for name, shape in _LAYER_SHAPES.items()})
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    for name, shape in tensors.items():
        data = rng.standard_normal(shape).astype(np.float32)
        qtype = QT.Q8_0 if data.ndim == 2 else QT.F32
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def _assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_second_load_comes_from_the_cache_with_identical_parameters(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    first = load_model(str(tiny_gguf), torch.float32, CPU, cache_dir=cache)
    second = load_model(str(tiny_gguf), torch.float32, CPU, cache_dir=cache)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.spec == first.spec
    _assert_same_parameters(first.module, second.module)
    assert [p.name for p in (cache / "weights").iterdir()] == [weights_cache.cache_path(cache, tiny_gguf).name]


def test_load_without_cache_dir_never_reports_from_cache(tiny_gguf):
    assert load_model(str(tiny_gguf), torch.float32, CPU).from_cache is False
    assert load_model(str(tiny_gguf), torch.float32, CPU).from_cache is False


def test_corrupt_cache_file_is_ignored_and_rewritten(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    reference = load_model(str(tiny_gguf), torch.float32, CPU)
    cached_file = weights_cache.cache_path(cache, tiny_gguf)
    cached_file.parent.mkdir(parents=True)
    cached_file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")
    assert weights_cache.load_cached(cached_file) is None

    repaired = load_model(str(tiny_gguf), torch.float32, CPU, cache_dir=cache)
    assert repaired.from_cache is False
    _assert_same_parameters(reference.module, repaired.module)
    assert weights_cache.load_cached(cached_file) is not None

    again = load_model(str(tiny_gguf), torch.float32, CPU, cache_dir=cache)
    assert again.from_cache is True
    _assert_same_parameters(reference.module, again.module)


def test_truncated_cache_file_is_ignored_and_rewritten(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    load_model(str(tiny_gguf), torch.float32, CPU, cache_dir=cache)
    cached_file = weights_cache.cache_path(cache, tiny_gguf)
    full = cached_file.read_bytes()
    cached_file.write_bytes(full[: len(full) // 2])  # a torn write
    assert load_model(str(tiny_gguf), torch.float32, CPU, cache_dir=cache).from_cache is False
    assert cached_file.read_bytes() == full


def test_cache_key_is_the_file_content_not_its_name(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=0)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(a.read_bytes())
    b = write_tiny_gguf(tmp_path / "b.gguf", seed=1)
    cache = tmp_path / "cache"
    assert weights_cache.cache_path(cache, a) == weights_cache.cache_path(cache, copy)
    assert weights_cache.cache_path(cache, a) != weights_cache.cache_path(cache, b)
    assert load_model(str(a), torch.float32, CPU, cache_dir=cache).from_cache is False
    assert load_model(str(copy), torch.float32, CPU, cache_dir=cache).from_cache is True
    assert load_model(str(b), torch.float32, CPU, cache_dir=cache).from_cache is False


def test_tied_embeddings_stay_tied_when_loaded_from_the_cache(tmp_path):
    path = write_tiny_gguf(tmp_path / "tied.gguf", tied=True)
    cache = tmp_path / "cache"
    load_model(str(path), torch.float32, CPU, cache_dir=cache)
    cached = load_model(str(path), torch.float32, CPU, cache_dir=cache)
    assert cached.from_cache is True and cached.spec.tie_word_embeddings is True
    assert cached.module.lm_head.weight is cached.module.model.embed_tokens.weight


def test_unwritable_cache_dir_still_loads_the_model(tiny_gguf, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder should be")
    loaded = load_model(str(tiny_gguf), torch.float32, CPU, cache_dir=blocker)
    assert loaded.from_cache is False
    assert "could not cache dequantized weights" in caplog.text


def test_store_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "weights" / "x.safetensors"
    weights_cache.store(target, {"w": torch.arange(6, dtype=torch.float32).view(2, 3).t()})
    assert [p.name for p in target.parent.iterdir()] == ["x.safetensors"]
    assert torch.equal(weights_cache.load_cached(target)["w"], torch.tensor([[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]))
