"""GGUF loading: shape from metadata, every tensor type dequantized, llama.cpp's Q/K row
permutation undone, HF names, and the fast metadata reader against `gguf.GGUFReader`.

The files are written here with `gguf.GGUFWriter` the way llama.cpp's convert_hf_to_gguf.py
writes a Llama: Q and K rows permuted for interleaved RoPE, norms kept in F32.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from engine.loader.gguf_loader import read_gguf_spec, read_gguf_weights
from engine.loader.gguf_meta import read_gguf_metadata, read_gguf_tensor_names
from engine.model.rope import rope_tables
from engine.model.spec import ModelSpec, RopeScaling

# Rows of 256 and 512: a whole number of blocks for every quant type (K-quants and TQ need 256).
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 2, 4, 2, 64, 256

_LAYER = {  # gguf name -> (HF name, [rows, cols])
    "attn_q": ("self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN)),
    "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_output": ("self_attn.o_proj", (HIDDEN, HEADS * HEAD_DIM)),
    "ffn_gate": ("mlp.gate_proj", (INTERMEDIATE, HIDDEN)),
    "ffn_up": ("mlp.up_proj", (INTERMEDIATE, HIDDEN)),
    "ffn_down": ("mlp.down_proj", (HIDDEN, INTERMEDIATE)),
    "attn_norm": ("input_layernorm", (HIDDEN,)),
    "ffn_norm": ("post_attention_layernorm", (HIDDEN,)),
}
_GLOBAL = {
    "token_embd.weight": ("model.embed_tokens.weight", (VOCAB, HIDDEN)),
    "output_norm.weight": ("model.norm.weight", (HIDDEN,)),
    "output.weight": ("lm_head.weight", (VOCAB, HIDDEN)),
}


def _names() -> dict[str, tuple[str, tuple[int, ...]]]:
    names = dict(_GLOBAL)
    for layer in range(LAYERS):
        for short, (hf, shape) in _LAYER.items():
            names[f"blk.{layer}.{short}.weight"] = (f"model.layers.{layer}.{hf}.weight", shape)
    return names


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of the permutation, found by permuting row indices (independent of the loader)."""
    rows = llama_cpp_permute(np.arange(w.shape[0])[:, None], n_head)[:, 0]
    out = np.empty_like(w)
    out[rows] = w
    return out


def _heads_for(hf_name: str) -> int | None:
    if hf_name.endswith("q_proj.weight"):
        return HEADS
    if hf_name.endswith("k_proj.weight"):
        return KV_HEADS
    return None


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {hf: rng.standard_normal(shape).astype(np.float32) for hf, shape in _names().values()}


def _quantizable_types() -> list[QT]:
    probe = np.linspace(-1.0, 1.0, 512, dtype=np.float32).reshape(2, 256)
    types = []
    for qtype in QT:
        try:
            quantize(probe, qtype)
        except NotImplementedError:
            continue
        types.append(qtype)
    return types


QUANT_TYPES = _quantizable_types()


def write_llama_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    qtype: QT = QT.F32,
    *,
    arch: str = "llama",
    tied: bool = False,
    extra_tensors: dict[str, np.ndarray] | None = None,
    vocab_size_key: bool = True,
    rope_linear_factor: float | None = None,
    key_length: int | None = None,
    rope_theta: float = 10000.0,
) -> dict[str, np.ndarray]:
    """Write a llama.cpp-style GGUF; returns what the loader should give back (HF names)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-gguf")
    writer.add_block_count(LAYERS)
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(rope_theta)
    if vocab_size_key:
        writer.add_vocab_size(VOCAB)
    else:
        writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    if rope_linear_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_linear_factor)
    if key_length is not None:
        writer.add_key_length(key_length)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    expected: dict[str, np.ndarray] = {}
    for gguf_name, (hf, _shape) in _names().items():
        if tied and hf == "lm_head.weight":
            continue
        w = weights[hf]
        heads = _heads_for(hf)
        stored = llama_cpp_permute(w, heads) if heads else w
        tensor_type = qtype if stored.ndim == 2 else QT.F32  # norms stay F32, as in llama.cpp
        data = quantize(stored, tensor_type)
        writer.add_tensor(gguf_name, data, raw_dtype=tensor_type)
        roundtrip = dequantize(data, tensor_type).astype(np.float32)
        expected[hf] = unpermute_rows(roundtrip, heads) if heads else roundtrip
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_quantize_covers_float_and_legacy_quant_types():
    names = {t.name for t in QUANT_TYPES}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"} <= names, sorted(names)


def test_read_gguf_spec_gives_exact_shape_fields(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_weights())
    assert read_gguf_spec(path) == ModelSpec(
        architecture="llama",
        name="tiny-gguf",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=float(np.float32(1e-5)),  # GGUF stores it as f32
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_scaling=RopeScaling(),
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def test_read_gguf_spec_takes_vocab_from_token_list_when_no_vocab_size_key(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_weights(), vocab_size_key=False)
    assert "llama.vocab_size" not in read_gguf_metadata(path)
    assert read_gguf_spec(path).vocab_size == VOCAB


def test_read_gguf_spec_reads_linear_rope_scaling_and_key_length(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_weights(), rope_linear_factor=4.0, key_length=32)
    spec = read_gguf_spec(path)
    assert spec.rope_scaling == RopeScaling(rope_type="linear", factor=4.0)
    assert spec.head_dim == 32


def test_f32_weights_equal_the_hf_layout_originals_exactly(tmp_path):
    path = tmp_path / "tiny.gguf"
    original = hf_weights()
    write_llama_gguf(path, original, QT.F32)
    weights = read_gguf_weights(path, read_gguf_spec(path))
    assert sorted(weights) == sorted(original)
    for name, want in original.items():
        got = weights[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert got.flags.writeable and got.flags.c_contiguous, name
        assert np.array_equal(got, want), f"{name} differs from the HF-layout original"
    # The stored Q/K really were permuted, so equality above proves the loader undid it.
    q = original["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q, HEADS), q)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=[t.name for t in QUANT_TYPES])
def test_every_quantized_type_loads_as_its_dequantized_roundtrip_unpermuted(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expected = write_llama_gguf(path, hf_weights(), qtype)
    weights = read_gguf_weights(path, read_gguf_spec(path))
    assert sorted(weights) == sorted(expected)
    for name, want in expected.items():
        assert weights[name].dtype == np.float32, name
        assert np.array_equal(weights[name], want), f"{qtype.name}: {name} differs"


def test_tied_embeddings_detected_when_the_file_has_no_output_weight(tmp_path):
    tied, untied = tmp_path / "tied.gguf", tmp_path / "untied.gguf"
    write_llama_gguf(tied, hf_weights(), tied=True)
    write_llama_gguf(untied, hf_weights())
    assert read_gguf_spec(tied).tie_word_embeddings is True
    assert read_gguf_spec(untied).tie_word_embeddings is False
    assert "lm_head.weight" not in read_gguf_weights(tied, read_gguf_spec(tied))


def test_unexpected_tensor_name_raises_value_error_naming_it(tmp_path):
    path = tmp_path / "extra.gguf"
    write_llama_gguf(path, hf_weights(), extra_tensors={"blk.0.attn_qkv.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensor 'blk\.0\.attn_qkv\.weight'"):
        read_gguf_weights(path, read_gguf_spec(path))


def test_non_llama_architecture_raises_value_error_naming_it(tmp_path):
    path = tmp_path / "qwen.gguf"
    write_llama_gguf(path, hf_weights(), arch="qwen2")
    with pytest.raises(ValueError, match=r"architecture 'qwen2' is not supported \(known: llama\)"):
        read_gguf_spec(path)


def test_a_file_that_is_not_gguf_raises_value_error(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf_metadata(path)


def test_llama3_rope_freqs_tensor_is_applied_not_dropped(tmp_path):
    # convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) writes one factor per
    # frequency and llama.cpp divides each frequency by it; no metadata key says "llama3".
    theta, old_len, factor, low, high = 500000.0, 8192, 8.0, 1.0, 4.0
    freqs = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    rope_factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            rope_factors.append(1.0)
        elif wavelen > old_len / low:
            rope_factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    path = tmp_path / "llama3.gguf"
    write_llama_gguf(path, hf_weights(), rope_theta=theta,
                     extra_tensors={"rope_freqs.weight": np.array(rope_factors, np.float32)})
    llama3 = RopeScaling("llama3", factor, low, high, old_len)
    want_cos, _ = rope_tables(HEAD_DIM, 256, theta, llama3, torch.device("cpu"))
    default_cos, _ = rope_tables(HEAD_DIM, 256, theta, RopeScaling(), torch.device("cpu"))
    assert not torch.allclose(default_cos, want_cos, atol=1e-2)  # the scaling matters here

    spec = read_gguf_spec(path)
    read_gguf_weights(path, spec)
    got_cos, _ = rope_tables(spec.head_dim, 256, spec.rope_theta, spec.rope_scaling, torch.device("cpu"))
    assert torch.allclose(got_cos, want_cos, atol=1e-4)


# --- the fast metadata reader against gguf.GGUFReader -------------------------------------


def _write_every_value_type(path: Path) -> None:
    VT = gguf.GGUFValueType
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_key_value("t.u8", 200, VT.UINT8)
    writer.add_key_value("t.i8", -100, VT.INT8)
    writer.add_key_value("t.u16", 60000, VT.UINT16)
    writer.add_key_value("t.i16", -30000, VT.INT16)
    writer.add_key_value("t.u32", 4_000_000_000, VT.UINT32)
    writer.add_key_value("t.i32", -2_000_000_000, VT.INT32)
    writer.add_key_value("t.u64", 2**63 + 5, VT.UINT64)
    writer.add_key_value("t.i64", -(2**62), VT.INT64)
    writer.add_key_value("t.f32", 0.1, VT.FLOAT32)
    writer.add_key_value("t.f64", 0.1, VT.FLOAT64)
    writer.add_key_value("t.bool_true", True, VT.BOOL)
    writer.add_key_value("t.bool_false", False, VT.BOOL)
    writer.add_key_value("t.str", "héllo ✓", VT.STRING)
    writer.add_key_value("t.empty_str", "", VT.STRING)
    writer.add_array("t.str_array", ["a", "", "ĠBé", "<|im_end|>"])
    writer.add_array("t.int_array", [3, -1, 7])
    writer.add_array("t.float_array", [0.5, -2.25, 1e-3])
    writer.add_array("t.empty_array", [])
    writer.add_name("tiny-gguf")
    writer.add_block_count(LAYERS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_scores([float(i) / 3 for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_tensor("token_embd.weight", np.ones((8, 32), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_read_gguf_metadata_equals_gguf_reader_for_every_key(tmp_path):
    path = tmp_path / "values.gguf"
    _write_every_value_type(path)
    reader = gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    got = read_gguf_metadata(path)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], f"{key}: {got[key]!r} != {want[key]!r}"
    assert got["t.u64"] == 2**63 + 5 and got["t.bool_true"] is True
    assert got["t.str_array"] == ["a", "", "ĠBé", "<|im_end|>"]


def test_read_gguf_tensor_names_equals_gguf_reader(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_weights(), tied=True, extra_tensors={"rope_freqs.weight": np.ones(32, np.float32)})
    want = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    assert read_gguf_tensor_names(path) == want
    assert len(want) == 2 + LAYERS * len(_LAYER) + 1
