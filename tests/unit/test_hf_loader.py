"""HF folders: config.json read into a ModelSpec, *.safetensors read as they are."""

from __future__ import annotations

import json

import pytest
import torch

from engine.loader.hf_loader import read_hf_spec, read_hf_weights
from engine.model.spec import ModelSpec, RopeScaling
from tests.tiny_model import TINY_CONFIG, write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("hf") / "tiny-llama")


def _write_config(folder, **overrides):
    cfg = {k: v for k, v in TINY_CONFIG.items() if overrides.get(k, 0) is not None}
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_read_hf_spec_of_the_tiny_model_folder_gives_exact_fields(tiny_dir):
    assert read_hf_spec(tiny_dir) == ModelSpec(
        architecture="llama",
        name="tiny-llama",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_scaling=RopeScaling(),
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def test_read_hf_weights_returns_every_tensor_under_its_hf_name(tiny_dir):
    weights = read_hf_weights(tiny_dir)
    assert len(weights) == 3 + 2 * 9
    assert weights["model.embed_tokens.weight"].shape == (49152, 64)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32


def test_unknown_architecture_raises_value_error_listing_known_ones(tmp_path):
    folder = _write_config(tmp_path / "m", architectures=["MistralForCausalLM"])
    with pytest.raises(
        ValueError, match=r"architectures \['MistralForCausalLM'\] not supported; known: \['LlamaForCausalLM'\]"
    ):
        read_hf_spec(folder)


def test_missing_config_json_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        read_hf_spec(tmp_path)


def test_folder_without_safetensors_raises_file_not_found(tmp_path):
    folder = _write_config(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match=r"has no \*\.safetensors files"):
        read_hf_weights(folder)


def test_missing_optional_keys_fall_back_to_llama_defaults(tmp_path):
    folder = _write_config(
        tmp_path / "m", architectures=None, num_key_value_heads=None, head_dim=None,
        rms_norm_eps=None, eos_token_id=None,
    )
    spec = read_hf_spec(folder)
    assert (spec.architecture, spec.num_kv_heads, spec.head_dim) == ("llama", 4, 16)
    assert (spec.rms_norm_eps, spec.eos_token_ids) == (1e-6, ())


def test_eos_token_id_list_becomes_a_tuple(tmp_path):
    folder = _write_config(tmp_path / "m", eos_token_id=[2, 7, 9])
    assert read_hf_spec(folder).eos_token_ids == (2, 7, 9)


def test_rope_scaling_dict_with_legacy_type_key_is_read(tmp_path):
    folder = _write_config(tmp_path / "m", rope_scaling={"type": "linear", "factor": 2.0})
    assert read_hf_spec(folder).rope_scaling == RopeScaling(rope_type="linear", factor=2.0)


def test_llama3_rope_scaling_dict_is_read(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    folder = _write_config(tmp_path / "m", rope_scaling=scaling, rope_theta=500000.0)
    spec = read_hf_spec(folder)
    assert spec.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert spec.rope_theta == 500000.0


def test_rope_parameters_written_by_transformers_5_are_read(tmp_path):
    from transformers import LlamaConfig

    params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_parameters=params)
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" not in saved and saved["rope_parameters"]["rope_type"] == "linear"
    spec = read_hf_spec(tmp_path)
    assert spec.rope_theta == 50000.0
    assert spec.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
