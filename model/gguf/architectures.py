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

Gemma 2 and 3 name their norms after where they sit: attn_norm, post_attention_norm, ffn_norm and
post_ffw_norm are input_layernorm, post_attention_layernorm, pre_feedforward_layernorm and
post_feedforward_layernorm. Phi-3 keeps its fused projections: attn_qkv is self_attn.qkv_proj and
ffn_up mlp.gate_up_proj (gate rows, then up rows).

What the converter changes, undone here:
- llama, smollm3 (converted as a Llama): the query/key rows of each head are interleaved (below).
- gemma2, gemma3: every norm weight is stored plus 1 (Gemma's RMSNorm computes x̂·(1 + w)); 1 is
  subtracted back. The query scale is not stored: llama.cpp takes 1/sqrt(head size), or, for the
  27B sizes (46 layers in Gemma 2, 62 in Gemma 3), 1/sqrt(hidden / heads); query_pre_attn_scalar is
  that choice. Windows: `<arch>.attention.sliding_window`, on the layers the per-layer
  `<arch>.attention.sliding_window_pattern` flags (or, as an integer n, all but every n-th; by
  default 2 for Gemma 2, 6 for Gemma 3; Gemma 2 without the key: 4096); Gemma 3's sliding layers
  rotate with `rope.freq_base_swa` (10000 when absent), unscaled.
- phi3: rope.dimension_count is the rotary width (partial_rotary_factor = it / head size); longrope
  is stored as the tensors rope_factors_long/short with rope.scaling.original_context_length and
  rope.scaling.attn_factor, and no scaling type. A sliding_window of 0 is none; another is kept as
  transformers applies it (import_hf refuses one shorter than the context; llama.cpp ignores it).
- smollm3: no metadata names the blocks without rotary positions; llama.cpp leaves out every 4th.

llama.cpp's converter interleaves the rows of each head of the query and key projections for the
`llama` and `smollm3` architectures (convert_hf_to_gguf.py, `LlamaModel.permute`: llama.cpp's rotary pairs
adjacent dimensions, Hugging Face's pairs the two halves of a head); `unpermute` puts them back.

An architecture not listed here or whose Hugging Face architecture import_hf does not read, a tensor an
architecture's table does not name, or a window on an architecture whose llama.cpp graph has none
(llama, qwen2, qwen3, smollm3: llama.cpp would attend over everything) is refused by name.
"""

from __future__ import annotations

import math
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
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope factors: config fields
CONFIG_TENSORS = (ROPE_FREQS, *LONGROPE)  # tensors that become config.json fields, not weights
GEMMA_BLOCK_NAMES = {**{k: v for k, v in BLOCK_NAMES.items() if not k.endswith(".bias")},
                     "post_attention_norm.weight": "post_attention_layernorm.weight",
                     "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
PHI3_BLOCK_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attn_qkv.weight": "self_attn.qkv_proj.weight",
                    "attn_output.weight": "self_attn.o_proj.weight",
                    "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_up.weight": "mlp.gate_up_proj.weight",
                    "ffn_down.weight": "mlp.down_proj.weight"}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's 27B sizes, whose query scale is 1/sqrt(hidden/heads)
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's default: all but every n-th layer sliding
GEMMA2_WINDOW = 4096  # llama.cpp's Gemma 2 window when the file names none
GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's (and Gemma 3's) sliding layers' rotary base when the file names none
SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp's SmolLM3: every 4th block without rotary positions
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
    norm_offset: float = 0.0  # what the converter added to every norm weight (Gemma's 1 of x̂·(1 + w))
    windowed: bool = False  # llama.cpp's graph reads <arch>.attention.sliding_window


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", True, BLOCK_NAMES),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2", False, BLOCK_NAMES),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3", False, {**BLOCK_NAMES, **QK_NORM_NAMES}),
    "smollm3": Architecture("SmolLM3ForCausalLM", "smollm3", True, BLOCK_NAMES),
    "phi3": Architecture("Phi3ForCausalLM", "phi3", False, PHI3_BLOCK_NAMES, windowed=True),
    "gemma2": Architecture("Gemma2ForCausalLM", "gemma2", False, GEMMA_BLOCK_NAMES, 1.0, True),
    "gemma3": Architecture("Gemma3ForCausalLM", "gemma3_text", False, {**GEMMA_BLOCK_NAMES, **QK_NORM_NAMES},
                           1.0, True),
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
    if ARCHITECTURES[arch].norm_offset and name.endswith("norm.weight"):
        w = w - np.float32(ARCHITECTURES[arch].norm_offset)
    return out, np.ascontiguousarray(w)


def hf_config(arch: str, meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
              config_tensors: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """config.json from the `<arch>.*` metadata; `tensor_shapes` (numpy order) gives the vocabulary and tying,
    `config_tensors` (the file's CONFIG_TENSORS it has) the llama3 and longrope rope scalings."""
    key = metadata_key(arch, meta)
    config_tensors = config_tensors or {}
    heads, hidden = key("attention.head_count"), key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    rotary = key("rope.dimension_count", head_dim)
    if rotary != head_dim and arch != "phi3":
        raise UnsupportedGGUF(f"{arch}.rope.dimension_count {rotary} is not the head size {head_dim} (partial rotary "
                              "positions are read for phi3 only)")
    hf = {
        "architectures": [ARCHITECTURES[arch].hf_architecture], "model_type": ARCHITECTURES[arch].model_type,
        "vocab_size": tensor_shapes["token_embd.weight"][0], "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"), "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim, "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0),
        "hidden_act": "silu", "tie_word_embeddings": "output.weight" not in tensor_shapes,
    }
    if key("attention.value_length", hf["head_dim"]) != hf["head_dim"]:
        raise UnsupportedGGUF(f"{arch}.attention.value_length differs from its key_length")
    if rotary != head_dim:
        hf["partial_rotary_factor"] = rotary / head_dim
    hf.update(rope_scaling(arch, meta, hf, config_tensors))
    hf.update(window_fields(arch, meta, hf["num_hidden_layers"]))
    if arch in ("gemma2", "gemma3"):
        del hf["hidden_act"]
        hf.update(gemma_fields(arch, meta, hf))
    if arch == "smollm3":
        hf["no_rope_layers"] = [int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(hf["num_hidden_layers"])]
    for name in ("bos", "eos"):
        if (i := meta.get(f"tokenizer.ggml.{name}_token_id")) is not None:
            hf[f"{name}_token_id"] = i
    return hf


def metadata_key(arch: str, meta: dict[str, Any]):
    """`key(name, default)`: the file's `<arch>.<name>`, or `default`; with neither, refused by name."""
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedGGUF(f"the file has no {arch}.{name}")
        return value
    return key


def rope_scaling(arch: str, meta: dict[str, Any], hf: dict[str, Any],
                 config_tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """{"rope_scaling": ...} as the metadata names it (linear, yarn), or as rope_freqs.weight (llama3) or
    rope_factors_long/short (Phi-3's longrope) hold it; {} for none."""
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        metadata_key(arch, meta)("rope.scaling.factor")
        if meta.get(f"{arch}.rope.scaling.yarn_ext_factor", 1.0) != 1.0:
            raise UnsupportedGGUF(f"{arch}.rope.scaling.yarn_ext_factor other than 1 is not supported")
        return {"rope_scaling": {"rope_type": scaling, **{ours: meta[f"{arch}.rope.scaling.{name}"]
                                                          for name, ours in SCALING_KEYS.items()
                                                          if f"{arch}.rope.scaling.{name}" in meta}}}
    if ROPE_FREQS in config_tensors:
        rotary = round(hf["head_dim"] * hf.get("partial_rotary_factor", 1.0))
        return {"rope_scaling": llama3_scaling(config_tensors[ROPE_FREQS], hf["rope_theta"], rotary)}
    if any(name in config_tensors for name in LONGROPE):
        return {"rope_scaling": longrope_scaling(arch, meta, hf, config_tensors)}
    return {}


def longrope_scaling(arch: str, meta: dict[str, Any], hf: dict[str, Any],
                     config_tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Phi-3's longrope from rope_factors_long/short and the original context; the attention factor the
    converter wrote must be the one transformers derives from the two contexts."""
    missing = [name for name in LONGROPE if name not in config_tensors]
    if missing:
        raise UnsupportedGGUF(f"the file has {' '.join(set(LONGROPE) - set(missing))} without {missing[0]}")
    original = metadata_key(arch, meta)("rope.scaling.original_context_length")
    scale = hf["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    stored = meta.get(f"{arch}.rope.scaling.attn_factor", derived)
    if not math.isclose(stored, derived, rel_tol=1e-6):
        raise UnsupportedGGUF(f"{arch}.rope.scaling.attn_factor {stored:g} is not the longrope factor {derived:g} "
                              "the contexts give")
    return {"rope_type": "longrope", "original_max_position_embeddings": original,
            "long_factor": [float(f) for f in config_tensors[LONGROPE[0]]],
            "short_factor": [float(f) for f in config_tensors[LONGROPE[1]]]}


def window_fields(arch: str, meta: dict[str, Any], n_layer: int) -> dict[str, Any]:
    """sliding_window and layer_types from `<arch>.attention.sliding_window(_pattern)`, as llama.cpp applies
    them; {} for none. Refused on an architecture whose llama.cpp graph does not window."""
    window = meta.get(f"{arch}.attention.sliding_window", GEMMA2_WINDOW if arch == "gemma2" else 0)
    if not window:
        return {}
    if not ARCHITECTURES[arch].windowed:
        raise UnsupportedGGUF(f"{arch}.attention.sliding_window {window} is not supported (llama.cpp's {arch} "
                              "attends over the whole context)")
    if arch == "phi3":  # every layer, as transformers' Phi-3 applies it
        return {"sliding_window": window}
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA_SWA_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise UnsupportedGGUF(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                                  f"{n_layer} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layer)]
    return {"sliding_window": window,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def gemma_fields(arch: str, meta: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma's activation, query scale (llama.cpp's choice, the file stores none), softcaps and local rotary."""
    fields = {"hidden_activation": "gelu_pytorch_tanh",
              "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping")}
    big = hf["num_hidden_layers"] == GEMMA_27B_LAYERS[arch]
    fields["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if big else hf["head_dim"]
    swa_theta = meta.get(f"{arch}.rope.freq_base_swa")
    if arch == "gemma2":
        fields["attn_logit_softcapping"] = meta.get(f"{arch}.attn_logit_softcapping")
        if swa_theta is not None and swa_theta != hf["rope_theta"]:
            raise UnsupportedGGUF(f"{arch}.rope.freq_base_swa {swa_theta:g} differs from rope.freq_base (Gemma 2 "
                                  "has one rotary base)")
    else:
        fields["rope_local_base_freq"] = GEMMA3_LOCAL_THETA if swa_theta is None else swa_theta
    return fields


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
