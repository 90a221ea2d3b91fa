"""GGUF files written in the test with `gguf.GGUFWriter`, as llama.cpp's converter writes them: a Hugging Face
checkpoint's tensors under the names gguf's own `TensorNameMap` gives them (the `llama` and `smollm3` query
and key rows permuted as convert_hf_to_gguf.py's `LlamaModel.permute` does, Gemma's norm weights plus 1, Phi-3's
longrope factors as rope_factors_long/short), its hyperparameters under the converter's metadata keys, and
tokenizer metadata."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from service.runtime.tokenizer import Tokenizer

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
PERMUTED = ("llama", "smollm3")  # converted by LlamaModel, which permutes the query/key rows


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute(w, n_head, n_head)`, as it reads there."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs.weight for a llama3 rope scaling (LlamaModel.generate_extra_tensors)."""
    rope = config["rope_parameters"]
    base, dim = rope["rope_theta"], config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low_freq_factor, high_freq_factor = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def byte_level_fields(tokenizer: Tokenizer, pre: str = "gpt-2", control: tuple[str, ...] = (),
                      user_defined: tuple[str, ...] = ()) -> dict:
    """tokenizer.ggml.* of a byte-level BPE tokenizer (ours): its tokens, merges and token types, and the
    `control` and `user_defined` tokens appended."""
    spec = json.loads(tokenizer.hf.to_str())
    tokens = [tokenizer.hf.id_to_token(i) for i in range(tokenizer.vocab_size)]
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [CONTROL if i in special else NORMAL for i in range(len(tokens))]
    for text, kind in [(t, CONTROL) for t in control] + [(t, USER_DEFINED) for t in user_defined]:
        tokens.append(text)
        types.append(kind)
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "merges": merges, "token_type": types,
            "bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id}


def sentencepiece_fields(texts: list[str], vocab_size: int = 400) -> dict:
    """tokenizer.ggml.* of a SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte pieces, then the
    pieces of a BPE trained here on `texts` ("▁" for spaces), each scored by how early it was learnt."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    hf.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False))
    pieces = [hf.id_to_token(i) for i in range(hf.get_vocab_size())]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {"model": "llama", "tokens": tokens, "scores": scores, "token_type": types, "bos_token_id": 1,
            "eos_token_id": 2, "unknown_token_id": 0}


def add_tokenizer(w: gguf.GGUFWriter, fields: dict) -> None:
    for key, value in fields.items():
        if value is None:  # left out of the file
            continue
        if key == "chat_template":
            w.add_chat_template(value)
        elif key == "scores":
            w.add_token_scores(value)
        elif isinstance(value, list):
            w.add_array(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, bool):
            w.add_bool(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"tokenizer.ggml.{key}", value)
        else:
            w.add_string(f"tokenizer.ggml.{key}", value)


def rope_of(config: dict) -> dict:
    """The rope parameters of a config.json (Gemma 3's of its full-attention layers)."""
    rope = config.get("rope_parameters") or {}
    return rope.get("full_attention", rope)


def add_arch_hparams(w: gguf.GGUFWriter, arch: str, config: dict) -> None:
    """What the converter writes beyond the common keys for Gemma 2/3 and Phi-3 (their windows, softcaps, local
    rotary base, partial rotary and longrope); Gemma 3's layer pattern as a per-layer flag array."""
    if arch in ("gemma2", "gemma3"):
        if config.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(config["final_logit_softcapping"])
        w.add_sliding_window(config["sliding_window"])
    if arch == "gemma3":
        w.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
        w.add_rope_freq_base_swa(config["rope_parameters"]["sliding_attention"]["rope_theta"])
    if arch == "phi3":
        rope = rope_of(config)
        w.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            w.add_rope_scaling_orig_ctx_len(original)
            scale = config["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))


def converted_tensors(arch: str, config: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` (HF names) as the converter changes them: Gemma's norms plus 1, Phi-3's longrope factors added."""
    out = {n: t + np.float32(1) if arch.startswith("gemma") and n.endswith("norm.weight") else t
           for n, t in tensors.items()}
    rope = rope_of(config)
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    return out


def add_hparams(w: gguf.GGUFWriter, config: dict) -> None:
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = rope_of(config)
    w.add_rope_freq_base(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary_fraction = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 1.0)
    w.add_rope_dimension_count(int(rotary_fraction * head_dim))
    if config.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rope.get("rope_type") in ("linear", "yarn"):  # as convert_hf_to_gguf.py writes them
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def write_gguf(path: Path, arch: str, tokenizer_fields: dict, config: dict | None = None,
               tensors: dict[str, np.ndarray] | None = None,
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """A GGUF file of `arch`: hyperparameters from a config.json (tiny ones when None), `tensors` under their
    Hugging Face names (none: a vocabulary-only file), matrices quantized to `qtype`."""
    config = config or dict(num_hidden_layers=1, max_position_embeddings=64, hidden_size=8, intermediate_size=16,
                            num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0)
    w = gguf.GGUFWriter(str(path), arch)
    add_hparams(w, config)
    add_arch_hparams(w, arch, config)
    add_tokenizer(w, tokenizer_fields)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    for name, t in converted_tensors(arch, config, tensors or {}).items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, config["num_attention_heads"])
        elif arch in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, config["num_key_value_heads"])
        ours = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if ours is None:  # a tensor of the test's own making: its name is kept
            ours = name
        if qtype != gguf.GGMLQuantizationType.F32 and t.ndim == 2:
            w.add_tensor(ours, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(ours, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def checkpoint_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    return load_file(str(hf_dir / "model.safetensors"))
