"""bench/real_shapes.py: every shape is a transformers config that import-hf takes as it is meant, and its
random weights are drawn as bench/sizes.py draws them (the builds themselves take minutes: not run here)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from bench.real_shapes import LLAMA_INIT, SHAPES, VOCAB, hf_gain, hf_kind  # noqa: E402
from model.hf import llama  # noqa: E402


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_imports_as_the_shape_it_names(name):
    shape = SHAPES[name]
    config = getattr(transformers, shape.architecture).config_class(vocab_size=VOCAB, eos_token_id=0, bos_token_id=0,
                                                                    pad_token_id=0, **shape.config)
    ours = llama.config_from_hf(config.to_dict(), llama.ARCHITECTURES[shape.architecture], [0])
    c = shape.config
    assert (ours.vocab_size, ours.n_layer, ours.d_model, ours.n_head, ours.kv_heads, ours.ff_width, ours.n_ctx) == (
        32000, c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
        c["intermediate_size"], c["max_position_embeddings"])
    assert ours.tie_embeddings and ours.qkv_bias == (shape.architecture == "Qwen2ForCausalLM")
    assert ours.rope_theta == c["rope_parameters"]["rope_theta"]
    if shape.architecture == "LlamaForCausalLM":  # llama-131k, llama-3.2-1b
        assert ours.rope_scaling["rope_type"] == "llama3" and ours.d_head == 64


def test_hf_parameters_are_drawn_as_the_random_sizes_draw_theirs():
    assert hf_kind("model.embed_tokens.weight", 2) == "embedding"
    assert hf_kind("model.layers.0.self_attn.q_proj.weight", 2) == "matrix"
    assert hf_kind("model.layers.0.self_attn.q_proj.bias", 1) == "bias"
    assert hf_kind("model.layers.0.input_layernorm.weight", 1) is None  # a norm's gain stays 1
    assert hf_gain("model.layers.3.self_attn.k_proj.weight") == LLAMA_INIT.qk_gain
    assert hf_gain("model.layers.3.mlp.down_proj.weight") == LLAMA_INIT.branch_scale
    assert hf_gain("model.layers.3.mlp.up_proj.weight") == 1.0
