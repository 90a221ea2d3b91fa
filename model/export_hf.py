"""Export an attnserve model directory as a Hugging Face GPT-2 directory (the inverse of `import_hf`).

    attnserve export-hf <model dir> -o <hf dir>     # or: python -m model.export_hf ...

The result loads with `transformers.GPT2LMHeadModel.from_pretrained(<hf dir>)` and
`PreTrainedTokenizerFast.from_pretrained(<hf dir>)`, offline: `config.json`, `model.safetensors`
(GPT-2 names, Conv1D weights as (in, out)), `generation_config.json`, `tokenizer.json` and
`tokenizer_config.json`. Only models GPT-2 can express are exported: learned positions, biases,
GELU (tanh or exact). The benchmarks run peers on exactly our weights through it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.checkpoint import TOKENIZER_FILE, load_model_dir
from model.config import GPTConfig
from model.import_hf import BLOCK_MAP, TOP_MAP
from service.runtime.tokenizer import EOS_TOKEN

HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


def hf_config(config: GPTConfig) -> dict:
    if config.pos_encoding != "learned":
        raise ValueError(f"GPT-2 has learned positions; this model uses {config.pos_encoding!r}")
    if not config.bias:
        raise ValueError("GPT-2 has biases in every linear layer and LayerNorm; this model has none")
    bos = config.bos_token_id if config.bos_token_id is not None else config.eos_token_id
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
        "bos_token_id": bos,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }


def hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> `GPT2LMHeadModel` names (the tied head is stored once, as wte)."""
    out = {f"transformer.{hf_name}": state[ours] for hf_name, ours in TOP_MAP}
    for i in range(config.n_layer):
        for hf_name, ours, transpose in BLOCK_MAP:
            t = state[f"blocks.{i}.{ours}"]
            out[f"transformer.h.{i}.{hf_name}"] = t.t() if transpose else t
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def export_hf(model_dir: str | Path, out: str | Path) -> Path:
    model, tokenizer = load_model_dir(model_dir)
    config = model.config
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(config)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                  "pad_token_id": cfg["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(hf_state_dict(model.state_dict(), config), str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(Path(model_dir) / TOKENIZER_FILE, out / TOKENIZER_FILE)
    eos = tokenizer.hf.id_to_token(tokenizer.eos_id) or EOS_TOKEN
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.n_ctx,
                  "bos_token": eos, "eos_token": eos, "unk_token": eos, "pad_token": eos,
                  "add_prefix_space": False, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnserve export-hf", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", help="attnserve model directory (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("-o", "--out", required=True, help="Hugging Face GPT-2 directory to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = export_hf(args.model_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"attnserve export-hf: {e}")
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
