"""Model directories: `config.json` + `model.safetensors` + `tokenizer.json`, like a Hugging Face one.

Weights are safetensors only, so loading a model directory never unpickles anything. Tied
weights (the output head shares the token embedding) are stored once. A decoder-only directory
holds a `GPT`; one whose config says `"kind": "encoder-decoder"` holds an `EncoderDecoder`
(`load_seq2seq_dir`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.config import GPTConfig
from model.gpt import GPT
from model.seq2seq import EncoderDecoder
from model.seq2seq_config import Seq2SeqConfig, is_seq2seq
from service.runtime.tokenizer import Tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TIED_HEAD = "lm_head.weight"


def save_model_dir(model: GPT | EncoderDecoder, tokenizer: Tokenizer, out_dir: str | Path,
                   metadata: dict[str, str] | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save(out / CONFIG_FILE)
    tokenizer.save(out / TOKENIZER_FILE)
    save_file(weights_for_saving(model), str(out / WEIGHTS_FILE), metadata={"format": "pt", **(metadata or {})})
    return out


def weights_for_saving(model: GPT | EncoderDecoder) -> dict[str, torch.Tensor]:
    """The state dict, without the output head when it is tied (it is `tok_emb.weight` again)."""
    tied = model.config.tie_embeddings
    return {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == TIED_HEAD)}


def load_weights(model: GPT | EncoderDecoder, path: str | Path) -> None:
    """Load safetensors weights into `model`; every parameter but the tied head must be present. Tensors are
    read and copied in one at a time, the file mapped for one tensor only, so loading holds the model once
    rather than twice (a copy of the file beside it, mapped or read)."""
    params = model.state_dict()  # the model's own tensors: copying into them loads the weights
    with safe_open(str(path), framework="pt") as f:
        names = {k: k for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    if "tok_emb.weight" not in names and TIED_HEAD in names:  # as `safetensors.torch.save_model` writes it
        names[TIED_HEAD] = "tok_emb.weight"
    ours = set(names.values())
    missing = set(params) - ours - ({TIED_HEAD} if model.config.tie_embeddings else set())
    unexpected = ours - set(params)
    if missing or unexpected:
        raise ValueError(f"{path} does not fit the config: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for stored, name in names.items():
            with safe_open(str(path), framework="pt") as f:
                tensor = f.get_tensor(stored)
            if tensor.shape != params[name].shape:
                raise ValueError(f"{path} does not fit the config: {stored} is {tuple(tensor.shape)}, the model's "
                                 f"{name} is {tuple(params[name].shape)}")
            params[name].copy_(tensor)


def load_model_dir(model_dir: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, Tokenizer]:
    """Load a decoder-only model directory for inference (eval mode)."""
    d = checked_dir(model_dir)
    if is_seq2seq(d / CONFIG_FILE):
        raise ValueError(f"{d} holds an encoder-decoder model (load it with load_seq2seq_dir)")
    return _load(d, GPT(GPTConfig.load(d / CONFIG_FILE)), device)


def load_seq2seq_dir(model_dir: str | Path, device: str | torch.device = "cpu") -> tuple[EncoderDecoder, Tokenizer]:
    """Load an encoder-decoder model directory for inference (eval mode)."""
    d = checked_dir(model_dir)
    if not is_seq2seq(d / CONFIG_FILE):
        raise ValueError(f"{d} holds a decoder-only model (load it with load_model_dir)")
    return _load(d, EncoderDecoder(Seq2SeqConfig.load(d / CONFIG_FILE)), device)


def checked_dir(model_dir: str | Path) -> Path:
    d = Path(model_dir)
    for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d} is not a model directory: {name} is missing")
    return d


def _load(d: Path, model, device):
    config = model.config
    tokenizer = Tokenizer.from_file(d / TOKENIZER_FILE, eos_id=config.eos_token_id)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}")
    load_weights(model, d / WEIGHTS_FILE)
    return model.to(device).eval(), tokenizer
