"""The engine's Llama on a tiny random model against HF transformers' LlamaForCausalLM.

Same weights, two independent implementations: greedy tokens must be identical and the
top-5 logprobs within 1e-4. The GGUF path is checked too: the same weights written the way
llama.cpp writes them (float32, Q/K rows permuted) must give the same tokens as the folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file

from engine import SamplingParams
from tests.tiny_model import tiny_llm

NUM_NEW_TOKENS = 20
TOP = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=TOP)
PROMPTS = [  # token ids; lengths 1, 4, 13, 48 and 150
    [1],
    [1, 504, 3458, 282],
    [(97 * i + 11) % 49000 + 50 for i in range(13)],
    [(7919 * i + 3) % 49000 + 50 for i in range(48)],
    [(31 * i * i + 5 * i + 17) % 49000 + 50 for i in range(150)],
]

_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _permute(w, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_f32_gguf(folder: Path, path: Path) -> Path:
    """The HF folder's weights as a float32 GGUF, laid out as llama.cpp's converter does."""
    cfg = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-gguf")
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        w = tensor.numpy()
        if name in _GGUF_GLOBAL:
            gguf_name = _GGUF_GLOBAL[name]
        else:
            _, _, layer, *module, _ = name.split(".")
            gguf_name = f"blk.{layer}.{_GGUF_LAYER['.'.join(module)]}.weight"
        if name.endswith("q_proj.weight"):
            w = _permute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _permute(w, cfg["num_key_value_heads"])
        writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    """Per prompt: the 20 greedy token ids, and [20, vocab] log-softmax of HF's logits."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.inference_mode():
        for ids in PROMPTS:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )
            tokens.append(tuple(out.sequences[0, len(ids):].tolist()))
            logprobs.append(torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
    return tokens, logprobs


@pytest.fixture(scope="module")
def folder_outputs(tiny_model_dir):
    return tiny_llm(tiny_model_dir).generate([list(p) for p in PROMPTS], GREEDY)


@pytest.fixture(scope="module")
def gguf_outputs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny-gguf")
    path = write_f32_gguf(tiny_model_dir, tmp / "tiny.gguf")
    llm = tiny_llm(path, weights_cache_dir=str(tmp / "cache"))
    return llm.generate([list(p) for p in PROMPTS], GREEDY)


def _first_differences(got, want) -> list[str]:
    diffs = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            j = next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)
            diffs.append(f"prompt {i} (len {len(PROMPTS[i])}): token {j}: {g[j]} != {w[j]}")
    return diffs


def _worst_top5_difference(outputs, ref_logprobs) -> float:
    worst = 0.0
    for out, ref in zip(outputs, ref_logprobs, strict=True):
        assert len(out.logprobs) == NUM_NEW_TOKENS
        for step, entries in enumerate(out.logprobs):
            hf_top = set(torch.topk(ref[step], TOP).indices.tolist())
            ours_top = {t for t, lp in entries.items() if lp.rank is not None and lp.rank <= TOP}
            assert ours_top == hf_top, f"step {step}: top-{TOP} {sorted(ours_top)} != HF {sorted(hf_top)}"
            for token_id, lp in entries.items():
                worst = max(worst, abs(lp.logprob - ref[step, token_id].item()))
    return worst


def test_tiny_model_greedy_tokens_equal_hf_for_prompts_of_varied_length(folder_outputs, hf_reference):
    tokens, _ = hf_reference
    got = [tuple(o.token_ids) for o in folder_outputs]
    assert not _first_differences(got, tokens), _first_differences(got, tokens)
    assert len({t for seq in tokens for t in seq}) > 5, "the reference must not be a constant sequence"


def test_tiny_model_top5_logprobs_agree_with_hf_within_1e_4(folder_outputs, hf_reference):
    _, logprobs = hf_reference
    worst = _worst_top5_difference(folder_outputs, logprobs)
    assert worst < 1e-4, f"largest top-{TOP} logprob difference {worst:.2e}"


def test_tiny_model_from_llama_cpp_style_f32_gguf_gives_the_folder_tokens(gguf_outputs, folder_outputs):
    got = [tuple(o.token_ids) for o in gguf_outputs]
    want = [tuple(o.token_ids) for o in folder_outputs]
    assert not _first_differences(got, want), _first_differences(got, want)


def test_tiny_model_from_f32_gguf_top5_logprobs_agree_with_hf_within_1e_4(gguf_outputs, hf_reference):
    _, logprobs = hf_reference
    worst = _worst_top5_difference(gguf_outputs, logprobs)
    assert worst < 1e-4, f"largest top-{TOP} logprob difference {worst:.2e}"
