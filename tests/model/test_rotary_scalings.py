"""The rope scalings against transformers' own: frequencies and attention factors against
`modeling_rope_utils`, and cos/sin against `LlamaRotaryEmbedding` at positions past the original context,
bit for bit. longrope's short factors below the original context and long ones from it, and dynamic NTK's
refusal."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

from model.hf.llama import Unsupported, rope_settings  # noqa: E402
from model.rotary import RotaryEmbedding, attention_factor, inverse_frequencies, rope_type  # noqa: E402

D, THETA, ORIGINAL, N_CTX = 32, 10000.0, 32, 128  # a head of 32, trained on 32 positions, served on 128
LONG = [1.0 + 0.5 * i for i in range(D // 2)]
SHORT = [1.0 + 0.05 * i for i in range(D // 2)]
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                         "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                              "attention_factor": 1.25},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                 "original_max_position_embeddings": ORIGINAL},  # factor from max_position_embeddings, as Phi-3
    "longrope-factor": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 2.0,
                        "original_max_position_embeddings": ORIGINAL},
}


def hf_config(scaling: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=4 * D, num_attention_heads=4, max_position_embeddings=N_CTX,
                                    rope_parameters={**scaling, "rope_theta": THETA})


def hf_cos_sin(scaling: dict, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin (B, T, D) for one forward call at `position_ids`, from a fresh rotary module."""
    return LlamaRotaryEmbedding(hf_config(scaling))(torch.zeros(1), position_ids)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_and_attention_factor_are_transformers(name):
    scaling = SCALINGS[name]
    config = hf_config(scaling)
    want, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    torch.testing.assert_close(inverse_frequencies(D, THETA, scaling), want, atol=0, rtol=0)
    assert attention_factor(scaling, N_CTX) == want_factor
    assert want_factor != 1.0  # every one of these scales cos and sin
    assert not torch.equal(want, inverse_frequencies(D, THETA))  # and moves the frequencies
    if scaling["rope_type"] == "longrope":
        want_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIGINAL + 1)
        torch.testing.assert_close(inverse_frequencies(D, THETA, scaling, long=True), want_long, atol=0, rtol=0)


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("length", [ORIGINAL, N_CTX], ids=["within", "past"])
def test_cos_sin_are_transformers_at_every_position(name, length):
    """The whole sequence in one call, within the original context and past it. Past it, longrope's positions
    below the original context keep the short factors: transformers' at a call that ends within it, as its
    cached generation of a prompt within the original context rotated them."""
    scaling, positions = SCALINGS[name], torch.arange(length)[None]
    want_cos, want_sin = hf_cos_sin(scaling, positions)
    if scaling["rope_type"] == "longrope" and length > ORIGINAL:
        short_cos, short_sin = hf_cos_sin(scaling, positions[:, :ORIGINAL])
        assert not torch.equal(short_cos, want_cos[:, :ORIGINAL])  # transformers rotated this call long throughout
        want_cos = torch.cat([short_cos, want_cos[:, ORIGINAL:]], dim=1)
        want_sin = torch.cat([short_sin, want_sin[:, ORIGINAL:]], dim=1)
    cos, sin = RotaryEmbedding(D, THETA, scaling, N_CTX)(positions)
    torch.testing.assert_close(cos[:, 0], want_cos, atol=0, rtol=0)
    torch.testing.assert_close(sin[:, 0], want_sin, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["longrope", "longrope-factor"])
def test_longrope_decode_steps_are_transformers_cached_steps(name):
    """One position per row, as decode steps: transformers' call at position p ends at p + 1, so it takes the
    long factors from the original context on, each row as it would alone."""
    scaling = SCALINGS[name]
    rows = torch.tensor([[0], [ORIGINAL - 1], [ORIGINAL], [N_CTX - 1]])
    cos, sin = RotaryEmbedding(D, THETA, scaling, N_CTX)(rows)
    for i, row in enumerate(rows):
        want_cos, want_sin = hf_cos_sin(scaling, row[None])
        torch.testing.assert_close(cos[i, 0], want_cos[0], atol=0, rtol=0)
        torch.testing.assert_close(sin[i, 0], want_sin[0], atol=0, rtol=0)
    all_short, _ = RotaryEmbedding(D, THETA, {**scaling, "long_factor": SHORT}, N_CTX)(rows)
    assert [torch.equal(cos[i], all_short[i]) for i in range(4)] == [True, True, False, False]


def test_longrope_factors_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="longrope factors must be 16 long"):
        inverse_frequencies(D, THETA, {**SCALINGS["longrope"], "short_factor": SHORT[:-1]})


def test_phi3_top_level_original_context_is_the_one_read():
    """Phi-3 keeps original_max_position_embeddings beside rope_scaling; transformers gives it priority."""
    hf = {"rope_theta": THETA, "max_position_embeddings": N_CTX, "original_max_position_embeddings": 16,
          "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}}
    _, scaling = rope_settings(hf)
    assert scaling["original_max_position_embeddings"] == 16
    _, yarn = rope_settings({"max_position_embeddings": N_CTX, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    assert yarn["original_max_position_embeddings"] == N_CTX  # none given: the context itself, as transformers


def test_dynamic_ntk_is_refused_by_name_with_its_reason():
    with pytest.raises(ValueError, match="'dynamic' is not supported: dynamic NTK recomputes .* KV cache"):
        rope_type({"rope_type": "dynamic", "factor": 2.0})
    hf = {"max_position_embeddings": N_CTX, "rope_scaling": json.loads('{"type": "dynamic", "factor": 2.0}')}
    with pytest.raises(Unsupported, match="'dynamic' is not supported"):
        rope_settings(hf)


def test_dynamic_ntk_is_the_unscaled_rope_within_max_position_embeddings():
    """What the refusal's advice rests on: transformers' dynamic frequencies at any length up to
    max_position_embeddings are the unscaled ones."""
    config = hf_config({"rope_type": "dynamic", "factor": 4.0})
    for seq_len in (None, 1, N_CTX):
        want, factor = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=seq_len)
        torch.testing.assert_close(inverse_frequencies(D, THETA), want, atol=0, rtol=0)
        assert factor == 1.0
    grown, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=N_CTX + 1)
    assert not torch.equal(grown, inverse_frequencies(D, THETA))
