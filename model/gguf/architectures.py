"""GGUF architectures -> Hugging Face ones: the config.json a GGUF file's `<arch>.*` metadata describes,
and the Hugging Face name of each of its tensors, one table per architecture.

    token_embd                  model.embed_tokens
    blk.i.attn_norm             model.layers.i.input_layernorm
    blk.i.attn_{q,k,v}          model.layers.i.self_attn.{q,k,v}_proj    (weight; qwen2 also bias)
    blk.i.attn_{q,k}_norm       model.layers.i.self_attn.{q,k}_norm      (qwen3)
    blk.i.attn_output           model.layers.i.self_attn.o_proj
    blk.i.ffn_norm              model.layers.i.post_attention_layernorm
    blk.i.ffn_{gate,up,down}    model.layers.i.mlp.{gate,up,down}_proj
    output_norm                 model.norm
    output                      lm_head                                  (absent when tied)

llama.cpp's converter interleaves the rows of each head of the query and key projections for the
`llama` architecture (convert_hf_to_gguf.py, `LlamaModel.permute`: llama.cpp's rotary pairs adjacent
dimensions, Hugging Face's pairs the two halves of a head); `unpermute` puts them back. Other
architectures are stored as Hugging Face has them.

An architecture not listed here or whose Hugging Face architecture import_hf does not read, or a tensor an
architecture's table does not name, is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from model.hf import llama

TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attn_output.weight": "self_attn.o_proj.weight",
               "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
               "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
               **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")}}
BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, as the factors each frequency is divided by: a config field
# <arch>.rope.scaling.* -> the Hugging Face rope scaling's field (as convert_hf_to_gguf.py writes them for yarn)
SCALING_KEYS = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
                "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor"}
LLAMA3_LOW, LLAMA3_HIGH = 1.0, 4.0  # Llama 3.1's low/high_freq_factor, taken where the factors leave them open


@dataclass(frozen=True)
class Architecture:
    hf_architecture: str  # config.json's `architectures[0]`, as import_hf reads it
    model_type: str  # config.json's `model_type`
    permuted_qk: bool  # the converter interleaved the query/key rows of each head (LlamaModel.permute)
    block_names: dict[str, str]  # GGUF name under blk.i -> HF name under model.layers.i


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", True, BLOCK_NAMES),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", False, BLOCK_NAMES),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3", False, {
        **BLOCK_NAMES, "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight"}),
}


class UnsupportedGGUF(ValueError):
    """An architecture, tensor or option of a GGUF file this importer does not convert; the message names it."""


def importable() -> list[str]:
    """The architectures whose Hugging Face architecture import_hf reads (a table may be ready before it)."""
    return [name for name, spec in ARCHITECTURES.items() if spec.hf_architecture in llama.ARCHITECTURES]


def architecture(meta: dict[str, Any]) -> tuple[str, Architecture]:
    name = meta.get("general.architecture")
    if name not in importable():
        raise UnsupportedGGUF(f"architecture {name!r} is not supported (supported: {', '.join(importable())})")
    return name, ARCHITECTURES[name]


def hf_name(arch: str, name: str) -> str:
    """The Hugging Face name of the GGUF tensor `name` of architecture `arch`."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    block = BLOCK.fullmatch(name)
    if block and block.group(2) in ARCHITECTURES[arch].block_names:
        return f"model.layers.{block.group(1)}.{ARCHITECTURES[arch].block_names[block.group(2)]}"
    raise UnsupportedGGUF(f"tensor {name!r} has no Hugging Face name in the {arch} architecture")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of the converter's `LlamaModel.permute(w, n_head, n_head)`: within each head, rows
    (pair j, half h) at 2j + h go back to h * head_dim/2 + j."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor(arch: str, name: str, w: np.ndarray, hf: dict[str, Any]) -> tuple[str, np.ndarray]:
    """(HF name, HF tensor) of the GGUF tensor `name` (float32, in numpy's row-major shape)."""
    out = hf_name(arch, name)
    if ARCHITECTURES[arch].permuted_qk:
        if out.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute(w, hf["num_attention_heads"])
        elif out.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute(w, hf["num_key_value_heads"])
    return out, np.ascontiguousarray(w)


def hf_config(arch: str, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
              rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """config.json from the `<arch>.*` metadata; `tensor_shapes` (numpy order) gives the vocabulary and tying,
    `rope_freqs` (the file's rope_freqs.weight, if any) the llama3 rope scaling."""
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedGGUF(f"the file has no {arch}.{name}")
        return value

    heads, hidden = key("attention.head_count"), key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    rotary = key("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise UnsupportedGGUF(f"{arch}.rope.dimension_count {rotary} is not the head size {head_dim} (partial rotary "
                              "positions are not supported)")
    hf = {
        "architectures": [ARCHITECTURES[arch].hf_architecture], "model_type": ARCHITECTURES[arch].model_type,
        "vocab_size": tensor_shapes["token_embd.weight"][0], "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"), "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim, "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "rope_theta": key("rope.freq_base", 10000.0),
        "hidden_act": "silu", "tie_word_embeddings": "output.weight" not in tensor_shapes,
    }
    if key("attention.value_length", hf["head_dim"]) != hf["head_dim"]:
        raise UnsupportedGGUF(f"{arch}.attention.value_length differs from its key_length")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        key("rope.scaling.factor")
        hf["rope_scaling"] = {"rope_type": scaling, **{ours: meta[f"{arch}.rope.scaling.{name}"]
                                                       for name, ours in SCALING_KEYS.items()
                                                       if f"{arch}.rope.scaling.{name}" in meta}}
        if meta.get(f"{arch}.rope.scaling.yarn_ext_factor", 1.0) != 1.0:
            raise UnsupportedGGUF(f"{arch}.rope.scaling.yarn_ext_factor other than 1 is not supported")
    elif rope_freqs is not None:
        hf["rope_scaling"] = llama3_scaling(rope_freqs, hf["rope_theta"], head_dim)
    for name in ("bos", "eos"):
        if (i := meta.get(f"tokenizer.ggml.{name}_token_id")) is not None:
            hf[f"{name}_token_id"] = i
    return hf


def llama3_factors(scaling: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """The rope_freqs convert_hf_to_gguf.py writes for a llama3 rope scaling (`generate_extra_tensors`)."""
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, blended))


def llama3_scaling(rope_freqs: np.ndarray, theta: float, dim: int) -> dict[str, Any]:
    """The llama3 rope scaling whose factors are `rope_freqs`. The factors fix only the ratios of its three
    lengths (original context, and that over each freq factor), so low_freq_factor is taken as Llama 3.1's;
    with fewer than two frequencies in the blend, high_freq_factor too. Refused when none reproduces them."""
    factors = np.asarray(rope_freqs, dtype=np.float64)
    factor = float(factors.max())
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    blend = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    low = high = LLAMA3_LOW
    if factors.shape != wavelen.shape or factor <= 1:
        raise UnsupportedGGUF(f"{ROPE_FREQS} holds {factors.size} factors up to {factor:g}, not a llama3 rope "
                              f"scaling of {dim // 2} frequencies")
    if blend.sum() >= 2:  # smooth = old_ctx / (high - low) / wavelen - low / (high - low), a line in 1 / wavelen
        smooth = (1 / factors[blend] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[blend], smooth, 1)
        high = low - low / intercept
        old_ctx = slope * (high - low)
    elif blend.sum() == 1:
        high = LLAMA3_HIGH
        smooth = (1 / factors[blend][0] - 1 / factor) / (1 - 1 / factor)
        old_ctx = (smooth * (high - low) + low) * wavelen[blend][0]
    else:  # any old_ctx with every unscaled wavelength below old_ctx / high and every scaled one above old_ctx
        high = LLAMA3_HIGH
        unscaled, scaled = wavelen[factors <= 1 + 1e-6], wavelen[factors > 1 + 1e-6]
        lowest = unscaled.max() * high if unscaled.size else 0.0
        old_ctx = (lowest + scaled.min()) / 2 if scaled.size else lowest * 2
    old_ctx, high = float(old_ctx), float(high)  # the fit's round numbers, where it is that close to them
    old_ctx = round(old_ctx) if abs(old_ctx - round(old_ctx)) < 1e-4 * old_ctx else old_ctx
    high = round(high, 3) if abs(high - round(high, 3)) < 1e-6 * high else high
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": old_ctx}
    if not np.allclose(llama3_factors(scaling, theta, dim), factors, rtol=1e-5):
        raise UnsupportedGGUF(f"{ROPE_FREQS}: no llama3 rope scaling gives these factors")
    return scaling
