"""Import a local Hugging Face checkpoint into an attnserve model directory: GPT-2, the Llama family
(`LlamaForCausalLM`, `Qwen2ForCausalLM`, `MistralForCausalLM`, `Qwen3ForCausalLM`, `SmolLM3ForCausalLM`,
`Phi3ForCausalLM`, `Gemma2ForCausalLM`; see `llama.py`), and the
encoder-decoder `BartForConditionalGeneration` (see `bart.py`).

    attnserve import-hf <hf dir> -o <model dir>     # or: python -m model.hf.import_hf ...

The source holds `config.json`, weights as `model.safetensors`, sharded safetensors
(`model.safetensors.index.json`), or for GPT-2 `pytorch_model.bin` (read with
`torch.load(weights_only=True)`, which refuses arbitrary pickled objects), and a tokenizer as
`tokenizer.json` (GPT-2 also `vocab.json` + `merges.txt`). `generation_config.json` gives the ids
that end generation; it, `tokenizer_config.json` and `chat_template.jinja` (special tokens, the chat
template) are kept in the model directory. Nothing is
downloaded. An architecture or option the decoder does not have is refused in one line.

GPT-2's Conv1D layers store weights as (in, out); our Linear layers store (out, in), so those
matrices are transposed. Every other tensor maps one to one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from model.checkpoint import save_model_dir
from model.config import GPTConfig
from model.gpt import GPT
from model.hf import bart, llama
from model.hf.cli import conversion_main
from model.seq2seq import EncoderDecoder
from service.runtime.bundle import TOKENIZER_EXTRAS
from service.runtime.tokenizer import Tokenizer

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}

# (HF name under a block, our name under a block, transpose?)
BLOCK_MAP = [(f"{hf}.{param}", f"{ours}.{param}", conv1d and param == "weight")
             for hf, ours, conv1d in [("ln_1", "ln_1", False), ("attn.c_attn", "attn.qkv_proj", True),
                                      ("attn.c_proj", "attn.out_proj", True), ("ln_2", "ln_2", False),
                                      ("mlp.c_fc", "ffn.fc_in", True), ("mlp.c_proj", "ffn.fc_out", True)]
             for param in ("weight", "bias")]  # GPT-2's Conv1D stores its weights transposed
TOP_MAP = [("wte.weight", "tok_emb.weight"), ("wpe.weight", "pos_emb.weight"),
           ("ln_f.weight", "ln_f.weight"), ("ln_f.bias", "ln_f.bias")]


def config_from_hf(hf: dict) -> GPTConfig:
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"only GPT-2 family checkpoints are supported, got model_type={hf.get('model_type')!r}")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported activation_function {act!r}; supported: {sorted(ACTIVATIONS)}")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        raise ValueError("checkpoints with non-standard attention scaling are not supported")
    eos = hf.get("eos_token_id")
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        n_ctx=hf.get("n_positions", hf.get("n_ctx", 1024)),
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        d_model=hf["n_embd"],
        d_ff=hf.get("n_inner"),
        dropout=0.0,
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=ACTIVATIONS[act],
        eos_token_id=eos if eos is not None else hf["vocab_size"] - 1,
        bos_token_id=hf.get("bos_token_id"),
    )


def read_hf_weights(src: Path) -> dict[str, torch.Tensor]:
    if (src / "model.safetensors").is_file():
        return load_file(str(src / "model.safetensors"))
    index = src / "model.safetensors.index.json"
    if index.is_file():
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(str(src / shard)))
        return state
    if (src / "pytorch_model.bin").is_file():
        return torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{src} has neither model.safetensors, model.safetensors.index.json nor "
                            "pytorch_model.bin")


def eos_ids(src: Path, hf: dict) -> list[int]:
    """Every id that ends generation: generation_config.json's eos_token_id (an id or a list), else config.json's."""
    gen = src / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos = hf.get("eos_token_id") if eos is None else eos
    if eos is None:
        raise llama.Unsupported("neither generation_config.json nor config.json names an eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos)


def convert_state_dict(hf_state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors -> our parameter names. Unused buffers (attn.bias, masked_bias) are dropped."""
    # GPT2LMHeadModel prefixes with "transformer."; a bare GPT2Model does not.
    state = {re.sub(r"^transformer\.", "", k): v for k, v in hf_state.items()}
    out: dict[str, torch.Tensor] = {}
    for hf_name, ours in TOP_MAP:
        out[ours] = state[hf_name]
    for i in range(config.n_layer):
        for hf_name, ours, transpose in BLOCK_MAP:
            t = state[f"h.{i}.{hf_name}"]
            out[f"blocks.{i}.{ours}"] = t.t().contiguous() if transpose else t
    out["lm_head.weight"] = out["tok_emb.weight"]
    if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state["wte.weight"]):
        raise ValueError("the checkpoint's lm_head is not tied to wte; attnserve models tie them")
    return {k: v.float() for k, v in out.items()}


def read_hf_tokenizer(src: Path, eos_id: int) -> Tokenizer:
    if (src / "tokenizer.json").is_file():
        return Tokenizer(HFTokenizer.from_file(str(src / "tokenizer.json")), eos_id)
    if (src / "vocab.json").is_file() and (src / "merges.txt").is_file():
        hf = HFTokenizer(models.BPE.from_file(str(src / "vocab.json"), str(src / "merges.txt")))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        eos = hf.id_to_token(eos_id)
        if eos is None:
            raise ValueError(f"eos_token_id {eos_id} is not in {src / 'vocab.json'}")
        hf.add_special_tokens([AddedToken(eos, special=True)])
        return Tokenizer(hf, eos_id)
    raise FileNotFoundError(f"{src} has neither tokenizer.json nor vocab.json + merges.txt")


def import_hf(src: str | Path, out: str | Path, source: str | None = None) -> Path:
    """`source` is the model directory's record of where it came from (default: huggingface-<architecture>)."""
    src = Path(src)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found")
    hf = json.loads(config_path.read_text())
    architecture = (hf.get("architectures") or ["GPT2LMHeadModel"])[0]
    if architecture in llama.ARCHITECTURES:
        config = llama.config_from_hf(hf, llama.ARCHITECTURES[architecture], eos_ids(src, hf))
        state = llama.convert_state_dict(read_hf_weights(src), config)
        if not (src / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{src} has no tokenizer.json (a SentencePiece tokenizer.model alone is not "
                                    "read; save the tokenizer with transformers to get one)")
        tokenizer = Tokenizer(HFTokenizer.from_file(str(src / "tokenizer.json")), config.eos_token_id)
    elif architecture == bart.ARCHITECTURE:
        return import_bart(src, hf, out)
    elif architecture in ("GPT2LMHeadModel", "GPT2Model"):
        config = config_from_hf(hf)
        state = convert_state_dict(read_hf_weights(src), config)
        tokenizer = read_hf_tokenizer(src, config.eos_token_id)
    else:
        supported = ", ".join(["GPT2LMHeadModel", *llama.ARCHITECTURES, bart.ARCHITECTURE])
        raise llama.Unsupported(f"architecture {architecture} is not supported (supported: {supported})")
    model = GPT(config)
    model.load_state_dict(state, strict=True)
    out = save_model_dir(model, tokenizer, out, metadata={"source": source or f"huggingface-{architecture}"})
    for name in TOKENIZER_EXTRAS:
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    return out


def import_bart(src: Path, hf: dict, out: str | Path) -> Path:
    """A BART checkpoint -> an encoder-decoder model directory (byte-level BPE tokenizer.json required)."""
    hf_state = read_hf_weights(src)
    config = bart.config_from_hf(hf, hf_state)
    gen = src / "generation_config.json"
    if gen.is_file():  # the ids generation uses, where they differ from config.json's
        ids = json.loads(gen.read_text())
        for key in ("decoder_start_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(ids.get(key), int):
                setattr(config, key, ids[key])
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src} has no tokenizer.json (save the tokenizer with transformers to get one)")
    tokenizer = Tokenizer(HFTokenizer.from_file(str(src / "tokenizer.json")), config.eos_token_id)
    model = EncoderDecoder(config)
    model.load_state_dict(bart.convert_state_dict(hf_state, config), strict=True)
    out = save_model_dir(model, tokenizer, out, metadata={"source": f"huggingface-{bart.ARCHITECTURE}"})
    for name in TOKENIZER_EXTRAS:
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    return out


def main(argv: list[str] | None = None) -> int:
    return conversion_main(argv, "attnserve import-hf", __doc__.split("\n\n")[0],
                           "local Hugging Face checkpoint directory (GPT-2, Llama, Qwen2, Mistral, Qwen3, SmolLM3, "
                           "Phi-3/4, Gemma 2, BART)",
                           "attnserve model directory to write", import_hf, (ValueError, FileNotFoundError, KeyError))


if __name__ == "__main__":
    raise SystemExit(main())
