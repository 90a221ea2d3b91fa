"""Export an attnserve model directory as a Hugging Face directory (the inverse of `import_hf`):
`GPT2LMHeadModel` for GPT-2-style models, `LlamaForCausalLM` (or `Qwen3ForCausalLM`, `SmolLM3ForCausalLM`,
`Phi3ForCausalLM`), `MistralForCausalLM`, `Qwen2ForCausalLM` or `Gemma2ForCausalLM` for Llama-style ones, and
`BartForConditionalGeneration` for an encoder-decoder BART can express (`bart.py`).

    attnserve export-hf <model dir> -o <hf dir>     # or: python -m model.hf.export_hf ...

The config chooses the architecture. Rotary positions, RMSNorm, SwiGLU and no biases make a Llama
(grouped-query KV heads, tied or untied head, rope_theta and rope_scaling kept), or the Llama-family class
that has what a Llama lacks: a Qwen3 for query/key norms, a SmolLM3 for blocks without rotary positions, a
Phi-3 for partial rotary (its `qkv_proj` and `gate_up_proj` written fused, as Phi-3 stores them); a head
width of its own is written as `head_dim` in any of them. (A Phi-3 rotating whole heads, or a SmolLM3 with
every block rotary, is a Llama: the same model, written as one.) The same with a sliding window on every layer
make a Mistral, with query/key/value biases (and a sliding window on any layers) a Qwen2. Rotary positions,
RMSNorm, GeGLU, norms after the sublayers and scaled embeddings make a Gemma 2 (its norm weights written as
w - 1, its attention scale as query_pre_attn_scalar, its soft-caps and windows kept), with query/key norms a
Gemma 3 (its rotary per layer kind as rope_parameters by layer type). Learned positions, LayerNorm, a GELU
MLP (tanh or exact), biases, one KV head per query head and a tied head make a GPT-2. A model none can express
(sinusoidal positions, a window on some layers with no biases, a mix of the families) is refused with the
reason. A model without a BOS id gets its EOS id as BOS, as
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


FAMILY_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "gemma2": "Gemma 2", "gemma3": "Gemma 3",
                "gpt2": "GPT-2"}


def family_needs(config: GPTConfig) -> dict[str, dict[str, bool]]:
    """For each architecture we write, what it needs of a model and whether this one has it."""
    c = config
    windows = [c.window(i) for i in range(c.n_layer)]
    rotary = {"rotary positions": c.pos_encoding == "rotary", "RMSNorm": c.norm == "rmsnorm"}
    plain = {"pre-norm blocks with unscaled embeddings and no soft-capping": not c.post_norms
             and not c.scale_embeddings and c.attn_scale is None and c.attn_softcap is None and c.final_softcap is None,
             "one rotary base for every layer": c.rope_local_theta is None}
    swiglu = {**rotary, "a SwiGLU MLP": c.mlp == "swiglu", **plain}
    # query/key norms, partial rotary and blocks without rotary positions are the Llama subclasses' alone
    llama_only = {"no query/key norms, partial rotary or blocks without rotary positions": llama_family(c) == "llama"}
    gemma = {**rotary, "a GeGLU MLP (tanh GELU)": c.mlp == "geglu" and c.activation == "gelu_tanh",
             "norms after each sublayer": c.post_norms, "scaled embeddings": c.scale_embeddings,
             "no biases": not c.bias and not c.qkv_bias,
             "an attention scale of 1 / sqrt(an integer)": query_pre_attn_scalar(c) is not None}
    return {
        "llama": {**swiglu, "no biases": not c.bias and not c.qkv_bias, "no sliding window": not any(windows)},
        "mistral": {**swiglu, **llama_only, "no biases": not c.bias and not c.qkv_bias,
                    "a sliding window on every layer": all(windows)},
        "qwen2": {**swiglu, **llama_only,
                  "biases on the query/key/value projection alone": not c.bias and c.qkv_bias is True},
        "gemma2": {**gemma, **llama_only, "one rotary base for every layer": c.rope_local_theta is None},
        "gemma3": {**gemma, "query/key norms": c.qk_norm,
                   "rotary on every dimension of every block": c.rotary_fraction == 1.0 and not c.no_rotary_layers},
        "gpt2": {"learned positions": c.pos_encoding == "learned", "LayerNorm": c.norm == "layernorm",
                 "a GELU MLP": c.mlp == "gelu", "biases in every linear layer and norm": c.bias
                 and c.qkv_bias in (None, True), "one KV head per query head": c.kv_heads == c.n_head,
                 "a head tied to the token embedding": c.tie_embeddings, "no sliding window": not any(windows),
                 **plain},
    }


def architecture(config: GPTConfig) -> str:
    """"llama", "mistral", "qwen2", "gemma2", "gemma3" or "gpt2", the first that expresses the model; ValueError naming
    what the closest one lacks."""
    needs = family_needs(config)
    for family, need in needs.items():
        if all(need.values()):
            return family
    lacks = {family: [name for name, ok in need.items() if not ok] for family, need in needs.items()}
    fewest = min(len(names) for names in lacks.values())
    closest = [f"{FAMILY_NAMES[family]}, which needs {', '.join(names)}" for family, names in lacks.items()
               if len(names) == fewest]
    raise ValueError(f"this model is none of {', '.join(FAMILY_NAMES.values())}: closest is {closest[0]}"
                     + "".join(f"; as close is {other}" for other in closest[1:]))


def query_pre_attn_scalar(config: GPTConfig) -> int | None:
    """Gemma 2's integer s of the attention scale s^-1/2; None when the scale is not of that form."""
    if config.attn_scale is None:
        return config.d_head
    s = round(config.attn_scale ** -2)
    return s if s > 0 and float(s) ** -0.5 == config.attn_scale else None


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
    family = architecture(config)
    if family == "gpt2":
        return gpt2_config(config)
    cfg = llama_config(config)
    layer_types = [("sliding_attention" if config.window(i) else "full_attention") for i in range(config.n_layer)]
    if family == "mistral":
        cfg |= {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": config.sliding_window}
    elif family == "qwen2":
        windowed = "sliding_attention" in layer_types
        cfg |= {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": windowed,
                "sliding_window": config.sliding_window if windowed else None, "layer_types": layer_types,
                "max_window_layers": layer_types.index("sliding_attention") if windowed else config.n_layer}
    elif family in ("gemma2", "gemma3"):
        for key in ("mlp_bias", "pretraining_tp", "hidden_act", "use_sliding_window", "max_window_layers"):
            cfg.pop(key, None)
        cfg |= {"architectures": [f"{family.capitalize()}ForCausalLM"], "model_type": family,
                "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": query_pre_attn_scalar(config),
                "sliding_window": config.sliding_window or config.n_ctx, "layer_types": layer_types,
                "attn_logit_softcapping": config.attn_softcap, "final_logit_softcapping": config.final_softcap}
    if family == "gemma3":  # a rotary per layer kind, by layer type as transformers 5 writes it, and the older keys
        local_theta = config.rope_local_theta or config.rope_theta
        local_scaling = config.rope_local_scaling if config.rope_local_theta is not None else config.rope_scaling
        cfg |= {"model_type": "gemma3_text", "rope_local_base_freq": local_theta, "rope_parameters": {
            "full_attention": {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta},
            "sliding_attention": {"rope_type": "default", **(local_scaling or {}), "rope_theta": local_theta}}}
    return cfg


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
    then the KV heads' keys, then their values, as `llama.convert_state_dict` stacks them; Qwen2's biases
    likewise), or for Phi-3 kept fused, with `fc_gate` and `fc_in` fused into `gate_up_proj` (gate rows first)
    as Phi-3 stores them; Gemma's norm weights back to its w of x̂·(1 + w)."""
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
            for param in ("weight", "bias") if config.qkv_bias else ("weight",):
                q, k, v = state[ours + f"attn.qkv_proj.{param}"].split([q_width, kv_width, kv_width])
                out |= {pre + f"self_attn.q_proj.{param}": q, pre + f"self_attn.k_proj.{param}": k,
                        pre + f"self_attn.v_proj.{param}": v}
            out |= {pre + hf_name: state[ours + name] for hf_name, name in llama.SEPARATE_MLP}
        for hf_name, name in llama.block_map(config):
            out[pre + hf_name] = state[ours + name]
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    if config.post_norms:
        norms = {"model.norm.weight"} | {f"model.layers.{i}.{hf_name}" for i in range(config.n_layer)
                                         for hf_name, ours in llama.block_map(config) if llama.is_norm(ours)}
        out = {k: v - 1.0 if k in norms else v for k, v in out.items()}
    return out


def hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict under the Hugging Face names of `architecture(config)`, fp32, contiguous."""
    to_hf = gpt2_state_dict if architecture(config) == "gpt2" else llama_state_dict
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
