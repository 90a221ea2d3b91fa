"""Export an attnserve model directory as a Hugging Face directory (the inverse of `import_hf`):
`GPT2LMHeadModel` for GPT-2-style models, `LlamaForCausalLM` (or `Qwen3ForCausalLM`, `SmolLM3ForCausalLM`,
`Phi3ForCausalLM`) for Llama-style ones, and
`BartForConditionalGeneration` for an encoder-decoder BART can express (`bart.py`).

    attnserve export-hf <model dir> -o <hf dir>     # or: python -m model.hf.export_hf ...

The config chooses the architecture. Rotary positions, RMSNorm, SwiGLU and no biases make a Llama
(grouped-query KV heads, tied or untied head, rope_theta and rope_scaling kept), or the Llama-family class
that has what a Llama lacks: a Qwen3 for query/key norms, a SmolLM3 for blocks without rotary positions, a
Phi-3 for partial rotary (its `qkv_proj` and `gate_up_proj` written fused, as Phi-3 stores them); a head
width of its own is written as `head_dim` in any of them. (A Phi-3 rotating whole heads, or a SmolLM3 with
every block rotary, is a Llama: the same model, written as one.) Learned positions,
LayerNorm, a GELU MLP (tanh or exact), biases, one KV head per query head and a tied head make a
GPT-2. A model neither can express (sinusoidal positions, Qwen2's query/key/value biases, a mix of
the two families) is refused with the reason. A model without a BOS id gets its EOS id as BOS, as
GPT-2 has (the tokenizer adds neither).

The result loads offline with `transformers.AutoModelForCausalLM.from_pretrained(<hf dir>)` and
`PreTrainedTokenizerFast.from_pretrained(<hf dir>)`: `config.json`, `model.safetensors` (GPT-2 Conv1D
weights as (in, out); Llama's q/k/v split out of our stacked `qkv_proj`, in the same rotate-half
layout, so nothing is permuted), `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`
and the model directory's `chat_template.jinja` when it has one. The benchmarks run peers on exactly
our weights through it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.checkpoint import CONFIG_FILE, TOKENIZER_FILE, load_model_dir, load_seq2seq_dir
from model.config import GPTConfig
from model.hf import bart, llama
from model.hf.cli import conversion_main
from model.hf.import_hf import BLOCK_MAP, TOP_MAP
from model.seq2seq_config import is_seq2seq
from service.runtime.tokenizer import EOS_TOKEN, Tokenizer

HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def architecture(config: GPTConfig) -> str:
    """"llama" or "gpt2", whichever expresses the model; ValueError naming what neither has."""
    llama_needs = {"rotary positions": config.pos_encoding == "rotary", "RMSNorm": config.norm == "rmsnorm",
                   "a SwiGLU MLP": config.mlp == "swiglu", "no biases": not config.bias and not config.qkv_bias}
    gpt2_needs = {"learned positions": config.pos_encoding == "learned", "LayerNorm": config.norm == "layernorm",
                  "a GELU MLP": config.mlp == "gelu", "biases in every linear layer and norm": config.bias
                  and config.qkv_bias in (None, True), "one KV head per query head": config.kv_heads == config.n_head,
                  "a head tied to the token embedding": config.tie_embeddings}
    if all(llama_needs.values()):
        return "llama"
    if all(gpt2_needs.values()):
        return "gpt2"
    family, needs = ("Llama", llama_needs) if config.pos_encoding == "rotary" else ("GPT-2", gpt2_needs)
    missing = ", ".join(name for name, ok in needs.items() if not ok)
    raise ValueError(f"this model is neither a GPT-2 nor a Llama: closest is {family}, which needs {missing}")


def llama_family(config: GPTConfig) -> str:
    """The Llama-family class that expresses a Llama-style model: "qwen3" for query/key norms, "smollm3" for
    blocks without rotary positions, "phi3" for partial rotary (its projections fused), else "llama"; a
    model that needs two of them is refused, naming what it has."""
    has = {"qwen3": config.qk_norm, "smollm3": bool(config.no_rotary_layers), "phi3": config.rotary_fraction != 1.0}
    wanted = [family for family, needed in has.items() if needed]
    if len(wanted) > 1:
        raise ValueError("no Hugging Face class has query/key norms, blocks without rotary positions and partial "
                         f"rotary together; this model needs {' and '.join(wanted)}")
    return wanted[0] if wanted else "llama"


def hf_config(config: GPTConfig) -> dict:
    """config.json for the architecture `architecture(config)` picks."""
    return llama_config(config) if architecture(config) == "llama" else gpt2_config(config)


def bos_id(config: GPTConfig) -> int:
    return config.bos_token_id if config.bos_token_id is not None else config.eos_token_id


def eos_value(config: GPTConfig) -> int | list[int]:
    """generation_config.json's eos_token_id: one id, or every id that ends generation."""
    return list(config.eos_token_ids) if config.eos_token_ids else config.eos_token_id


def gpt2_config(config: GPTConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_ctx,
        "n_ctx": config.n_ctx,
        "n_embd": config.d_model,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.d_ff,
        "activation_function": HF_ACTIVATION[config.activation],
        "layer_norm_epsilon": config.layer_norm_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": bos_id(config),
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }


FAMILY_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                  "phi3": "Phi3ForCausalLM"}


def family_fields(config: GPTConfig, family: str) -> dict:
    """What a Qwen3, SmolLM3 or Phi-3 config.json says beyond a Llama's: no sliding window anywhere, SmolLM3's
    rotary flag per block (1 = rotary), Phi-3's rotated share; a pad id inside the vocabulary (their defaults
    lie beyond small vocabularies)."""
    if family == "llama":
        return {}
    fields = {"sliding_window": None, "pad_token_id": config.eos_token_id}
    if family in ("qwen3", "smollm3"):
        fields |= {"use_sliding_window": False, "max_window_layers": config.n_layer}
    if family == "smollm3":
        fields["no_rope_layers"] = [int(config.uses_rotary(i)) for i in range(config.n_layer)]
    if family == "phi3":
        fields |= {"partial_rotary_factor": config.rotary_fraction, "original_max_position_embeddings": config.n_ctx,
                   "resid_pdrop": 0.0, "embd_pdrop": 0.0}
    return fields


def llama_config(config: GPTConfig) -> dict:
    # rope_theta and rope_scaling as transformers 4 (and llama.cpp's and CTranslate2's converters) read
    # them; rope_parameters as transformers 5 writes them
    family = llama_family(config)
    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    if family == "phi3":
        rope["partial_rotary_factor"] = config.rotary_fraction
    return {
        "architectures": [FAMILY_CLASSES[family]],
        "model_type": family,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.n_ctx,
        "hidden_size": config.d_model,
        "intermediate_size": config.ff_width,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.d_head,
        "hidden_act": "silu",
        "rms_norm_eps": config.layer_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "tie_word_embeddings": config.tie_embeddings,
        "use_cache": True,
        "bos_token_id": bos_id(config),
        "eos_token_id": eos_value(config),
        "torch_dtype": "float32",
        **family_fields(config, family),
    }


def gpt2_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> `GPT2LMHeadModel` names (the tied head is stored once, as wte)."""
    out = {f"transformer.{hf_name}": state[ours] for hf_name, ours in TOP_MAP}
    for i in range(config.n_layer):
        for hf_name, ours, transpose in BLOCK_MAP:
            t = state[f"blocks.{i}.{ours}"]
            out[f"transformer.h.{i}.{hf_name}"] = t.t() if transpose else t
    return out


def llama_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> the Llama-family class's names: `qkv_proj` split into q, k and v (queries first,
    then the KV heads' keys, then their values, as `llama.convert_state_dict` stacks them), or for Phi-3 kept
    fused, with `fc_gate` and `fc_in` fused into `gate_up_proj` (gate rows first) as Phi-3 stores them."""
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["ln_f.weight"]}
    q_width, kv_width = config.n_head * config.d_head, config.kv_heads * config.d_head
    fused = llama_family(config) == "phi3"
    for i in range(config.n_layer):
        pre, ours = f"model.layers.{i}.", f"blocks.{i}."
        qkv = state[ours + "attn.qkv_proj.weight"]
        if fused:
            out[pre + "self_attn.qkv_proj.weight"] = qkv
            out[pre + "mlp.gate_up_proj.weight"] = torch.cat([state[ours + "ffn.fc_gate.weight"],
                                                              state[ours + "ffn.fc_in.weight"]])
        else:
            q, k, v = qkv.split([q_width, kv_width, kv_width])
            out |= {pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k,
                    pre + "self_attn.v_proj.weight": v}
            out |= {pre + hf_name: state[ours + name] for hf_name, name in llama.SEPARATE_MLP}
        for hf_name, name in llama.block_map(config):
            out[pre + hf_name] = state[ours + name]
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out


def hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict under the Hugging Face names of `architecture(config)`, fp32, contiguous."""
    to_hf = llama_state_dict if architecture(config) == "llama" else gpt2_state_dict
    return {k: v.detach().float().contiguous() for k, v in to_hf(state, config).items()}


def tokenizer_config(tokenizer: Tokenizer, config: GPTConfig) -> dict:
    eos = tokenizer.hf.id_to_token(tokenizer.eos_id) or EOS_TOKEN
    bos = tokenizer.hf.id_to_token(bos_id(config)) or eos
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.n_ctx,
            "bos_token": bos, "eos_token": eos, "unk_token": eos, "pad_token": eos,
            "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False}


def export_bart(model_dir: Path, out: Path) -> Path:
    """An encoder-decoder model directory as `BartForConditionalGeneration` (`bart` says what it needs)."""
    model, tokenizer = load_seq2seq_dir(model_dir)
    c = model.config
    cfg = bart.hf_config(c)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {key: cfg[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(bart.hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(model_dir / TOKENIZER_FILE, out / TOKENIZER_FILE)
    if (model_dir / TOKENIZER_CONFIG_FILE).is_file():
        shutil.copyfile(model_dir / TOKENIZER_CONFIG_FILE, out / TOKENIZER_CONFIG_FILE)
    else:
        names = {role: tokenizer.hf.id_to_token(i) for role, i in (
            ("bos_token", cfg["bos_token_id"]), ("eos_token", c.eos_token_id), ("pad_token", c.pad_token_id))}
        unk = "<unk>" if tokenizer.hf.token_to_id("<unk>") is not None else names["eos_token"]
        names["unk_token"] = unk  # CTranslate2's converter writes it into its config, where it must be a string
        (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": c.n_src_ctx, **names,
             "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    return out


def export_hf(model_dir: str | Path, out: str | Path) -> Path:
    model_dir, out = Path(model_dir), Path(out)
    if (model_dir / CONFIG_FILE).is_file() and is_seq2seq(model_dir / CONFIG_FILE):
        return export_bart(model_dir, out)
    model, tokenizer = load_model_dir(model_dir)
    config = model.config
    cfg = hf_config(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos_value(config),
                  "pad_token_id": config.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(hf_state_dict(model.state_dict(), config), str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(model_dir / TOKENIZER_FILE, out / TOKENIZER_FILE)
    if (model_dir / TOKENIZER_CONFIG_FILE).is_file():  # an imported checkpoint's own, kept as it was
        shutil.copyfile(model_dir / TOKENIZER_CONFIG_FILE, out / TOKENIZER_CONFIG_FILE)
    else:
        tok_config = tokenizer_config(tokenizer, config)
        (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_config, indent=2) + "\n")
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        shutil.copyfile(model_dir / CHAT_TEMPLATE_FILE, out / CHAT_TEMPLATE_FILE)
    return out


def main(argv: list[str] | None = None) -> int:
    return conversion_main(argv, "attnserve export-hf", __doc__.split("\n\n")[0],
                           "attnserve model directory (config.json, model.safetensors, tokenizer.json)",
                           "Hugging Face directory to write", export_hf, (FileNotFoundError, ValueError))


if __name__ == "__main__":
    raise SystemExit(main())
