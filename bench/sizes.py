"""The three model sizes the comparison benchmarks run, each ready for every system on the same weights.

    from bench.sizes import SIZES, prepare
    p = prepare("gpt2-124m", Path("runs/sizes"))   # p.model_dir, p.hf_dir, p.bundle, ...

- "shipped": models/shakespeare as it is (trained, Llama-style), its Hugging Face directory from
  `export-hf` and a bundle exported fresh.
- "gpt2-124m": GPT-2 124M's shape (12 layers, 12 heads, width 768, vocabulary 50257, context 1024),
  random weights, a `GPT2LMHeadModel` for the peers.
- "smollm2-135m": SmolLM2-135M's shape (30 layers, 9 heads, 3 KV heads, width 576, intermediate 1536,
  vocabulary 49152, context 2048, tied embeddings, rope_theta 100000), random weights, a
  `LlamaForCausalLM` for the peers.

Each size is an attnserve model directory, the same weights as a Hugging Face directory and a bundle
of the serving graphs, built once under `work/<size>/` and reused while its stamp matches. How the
random weights are drawn so that greedy text stays varied and quantisation stays meaningful, and the
tokenizer of the random sizes: docs/BENCHMARKS.md#how-the-model-sizes-are-built.
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.commands.llama_shape import SMOLLM2_135M
from bench.commands.quantization import GPT2_SHAPE
from service.runtime.bundle import sha256_file

SIZES = ("shipped", "gpt2-124m", "smollm2-135m")
ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = ROOT / "models" / "shakespeare"
STAMP = "prepared.json"
RECIPE = 3  # bumped when the weights, the tokenizer or the bundle of a size would change; the stamp records it

SEED = 0
# norm of a random model's token and position embeddings (std EMBEDDING_NORM / sqrt(d_model)); through the tied
# head, the std of its logits
EMBEDDING_NORM = 4.0


@dataclass(frozen=True)
class Init:
    """How a random size's weights are drawn (see the module docstring)."""

    qk_gain: float  # query and key weights × this: attention scores of std about qk_gain²
    branch_scale: float = 1.0  # the attention and feed-forward output projections × this
    position_scale: float = 1.0  # learned position embeddings × this (GPT-2 layout)


# Chosen by a sweep on each shape (the module docstring): lively enough not to repeat one token, and as
# robust to 8-bit and 4-bit weights as the trained shipped model (sharper attention or stronger residual
# branches make a random model chaotic, and then every quantised engine's greedy text departs from fp32's
# within a few tokens)
INIT = {"gpt2-124m": Init(qk_gain=1.5, branch_scale=0.5, position_scale=3.0),
        "smollm2-135m": Init(qk_gain=1.5, branch_scale=0.5)}
# max |Δlogits| of a random model's fp32 serving graph against PyTorch: fp32 rounding, amplified by the sharp
# attention (PyTorch fp32 against float64, logits of std 4: 5.7e-4 at most at 124M, 1.6e-4 at 135M)
VERIFY_TOL = 2e-3
BIAS_STD = 0.02
MIN_DISTINCT = 2  # fewest distinct tokens a random model must produce in 128 greedy ones, in every row: it never
# collapses into repeating one token

LLAMA_STYLE = dict(pos_encoding="rotary", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=True)
SHAPES = {  # GPTConfig fields of the random sizes
    "gpt2-124m": dict(GPT2_SHAPE, eos_token_id=0),
    "smollm2-135m": dict(vocab_size=SMOLLM2_135M["vocab"], n_ctx=SMOLLM2_135M["context"],
                         n_layer=SMOLLM2_135M["layers"], n_head=SMOLLM2_135M["heads"],
                         n_kv_head=SMOLLM2_135M["kv_heads"], d_model=SMOLLM2_135M["hidden"],
                         d_ff=SMOLLM2_135M["intermediate"], layer_norm_eps=1e-5, rope_theta=100000.0, eos_token_id=0,
                         **LLAMA_STYLE),
}


@dataclass(frozen=True)
class Prepared:
    size: str  # one of SIZES
    model_dir: Path  # attnserve model directory (config.json, model.safetensors, tokenizer.json ...)
    hf_dir: Path  # the same weights as a Hugging Face directory (export-hf): GPT2LMHeadModel or LlamaForCausalLM
    bundle: Path  # ONNX bundle: graphs "static" (fp32), "static-int8", "static-int8-per-tensor", and "static-int4"
    # when export supports it
    arch: str  # "gpt" or "llama"
    parameters: int  # parameters of the model, the tied head counted once
    vocab_size: int  # ids the embedding and the output head cover (= the tokenizer's)
    n_ctx: int  # longest sequence the model attends over


@dataclass(frozen=True)
class Liveliness:
    """What greedy decoding of random prompts looks like: is the model's output varied, are its choices clear?"""

    distinct: list[int]  # distinct tokens among each row's new tokens
    new_tokens: int  # new tokens per row
    mean_margin: float  # mean over every step of (top-1 logit - top-2 logit)
    min_margin: float  # the smallest such margin


def prepare(size: str, work: Path, int4: bool = True, shape: dict | None = None,
            qk_gain: float | None = None) -> Prepared:
    """Build (or reuse, if already in `work`) the model of this size.

    `shape` overrides GPTConfig fields of a random size and `qk_gain` its QK_GAIN (the tests build tiny
    models, which need sharper attention than the real sizes to stay lively); the shipped model takes
    neither. `int4` asks for the "static-int4" graph too, when `export_bundle` can write it."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; the sizes are {SIZES}")
    if size == "shipped" and (shape or qk_gain):
        raise ValueError("the shipped model has its own weights; `shape` and `qk_gain` apply to a random size")
    from model.config import GPTConfig

    root = Path(work) / size
    model_dir = SHIPPED_MODEL if size == "shipped" else root / "model"
    config = GPTConfig.load(SHIPPED_MODEL / "config.json") if size == "shipped" else GPTConfig(
        **{**SHAPES[size], **(shape or {})})
    init = Init(qk_gain) if qk_gain else INIT.get(size)
    want = {"size": size, "recipe": RECIPE, "seed": SEED, "init": asdict(init) if init else None,
            "config": config.to_dict(), "int4": int4 and int4_supported()}
    if size == "shipped":
        want["weights_sha256"] = sha256_file(SHIPPED_MODEL / "model.safetensors")
    stamp = read_stamp(root / STAMP)
    if {k: stamp.get(k) for k in want} != want:
        stamp = build(size, config, root, model_dir, want)
    return Prepared(size=size, model_dir=model_dir, hf_dir=root / "hf", bundle=root / "bundle",
                    arch="llama" if config.pos_encoding == "rotary" else "gpt", parameters=stamp["parameters"],
                    vocab_size=config.vocab_size, n_ctx=config.n_ctx)


def build(size: str, config, root: Path, model_dir: Path, want: dict) -> dict:
    """Write the model directory (random sizes), the HF directory and the bundle; check them; write the stamp."""
    from export.verify import verify_static
    from model.checkpoint import load_model_dir, save_model_dir
    from model.hf.export_hf import export_hf

    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    if size != "shipped":
        save_model_dir(random_model(config, Init(**want["init"])), bpe_tokenizer(config.vocab_size), model_dir,
                       metadata={"source": f"random-{size}"})
    model, _ = load_model_dir(model_dir)
    lively = liveliness(model)
    if size != "shipped" and min(lively.distinct) < MIN_DISTINCT:
        raise RuntimeError(f"the random {size} model collapses under greedy decoding: {lively.distinct} distinct "
                           f"tokens in {lively.new_tokens} per row (at least {MIN_DISTINCT} wanted)")
    export_hf(model_dir, root / "hf")
    graphs = write_bundle(model_dir, root / "bundle", size, want["int4"])
    report = verify_static(model, root / "bundle", "static", tol=1e-4 if size == "shipped" else VERIFY_TOL)
    if not report.passed:
        raise RuntimeError(f"the {size} bundle's static graph differs from PyTorch:\n{report.format()}")
    stamp = {**want, "parameters": model.num_parameters(), "graphs": graphs, "liveliness": asdict(lively),
             "static_max_abs_diff": {c.name: c.max_abs_diff for c in report.checks}}
    (root / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    return stamp


def int4_supported() -> bool:
    from export.bundle_writer import export_bundle

    return "int4" in inspect.signature(export_bundle).parameters


def write_bundle(model_dir: Path, out: Path, name: str, int4: bool) -> list[str]:
    """The serving graphs: static (fp32), static-int8, static-int8-per-tensor, static-int4 when asked (the
    standard fp32 graph is left out; its INT8 form stays, as `export --int8 --no-fp32` writes)."""
    from export.bundle_writer import export_bundle
    from export.variants import INT4

    extra = {"int4": INT4} if int4 else {}
    return export_bundle(model_dir, out, name=name, int8=True, int8_per_tensor=True, keep_fp32=False,
                         **extra)


def random_model(config, init: Init, seed: int = SEED):
    """A GPT of `config` with lively random weights (see the module docstring), in eval mode."""
    import torch

    from model.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(config).eval()
    gen = torch.Generator().manual_seed(seed)
    queries_and_keys = config.d_model + config.kv_heads * config.d_head  # the first rows of qkv_proj
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is tok_emb.weight, listed once
            kind = ("embedding" if name in ("tok_emb.weight", "pos_emb.weight", "lm_head.weight") else "matrix"
                    if p.dim() == 2 else "bias" if name.endswith(".bias") else None)
            if kind:
                draw_lively_(p, kind, gen, config.d_model,
                             init.branch_scale if name.endswith(("out_proj.weight", "fc_out.weight")) else 1.0)
            if name.endswith("qkv_proj.weight"):
                p[:queries_and_keys] *= init.qk_gain
            if name == "pos_emb.weight":
                p *= init.position_scale
    return model


def draw_lively_(p, kind: str, gen, d_model: int, gain: float = 1.0) -> None:
    """Draw parameter `p` in place as a random size's weights are drawn (the module docstring): `kind`
    "embedding" (an embedding, or an untied head) N(0, (EMBEDDING_NORM / sqrt(d_model))²), "matrix" (a Linear
    weight, (out, in)) N(0, 1 / in) × `gain`, "bias" N(0, BIAS_STD²). Norm gains are left as they are."""
    import torch

    if kind == "embedding":
        p.copy_(torch.randn(p.shape, generator=gen) * EMBEDDING_NORM / math.sqrt(d_model))
    elif kind == "matrix":
        p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        if gain != 1.0:
            p *= gain
    elif kind == "bias":
        p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
    else:
        raise ValueError(f"kind must be embedding, matrix or bias, got {kind!r}")


def liveliness(model, rows: int = 4, prompt_tokens: int = 16, new_tokens: int = 128, seed: int = SEED) -> Liveliness:
    """Greedy-decode `rows` random prompts of `prompt_tokens` ids (fewer new tokens if the context is shorter)
    with the PyTorch model; count each row's distinct new tokens and measure the top-1 margins."""
    import torch

    new_tokens = min(new_tokens, model.config.n_ctx - prompt_tokens)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt_tokens), generator=gen)
    cache = model.new_kv_cache(rows, prompt_tokens + new_tokens)
    out, margins = [], []
    with torch.no_grad():
        logits = model(ids, kv_cache=cache)[:, -1]  # (rows, vocab)
        for _ in range(new_tokens):
            top = logits.topk(2, dim=-1).values  # (rows, 2)
            margins.append(top[:, 0] - top[:, 1])
            nxt = logits.argmax(-1, keepdim=True)  # (rows, 1)
            out.append(nxt)
            logits = model(nxt, kv_cache=cache)[:, -1]
    tokens = torch.cat(out, dim=1)  # (rows, new_tokens)
    margin = torch.cat(margins)
    return Liveliness(distinct=[len(set(row.tolist())) for row in tokens], new_tokens=new_tokens,
                      mean_margin=margin.mean().item(), min_margin=margin.min().item())


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE of exactly `vocab_size` ids, `<|endoftext|>` = 0 (see the module docstring)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from model.training.data import load_plays
    from model.training.tokenizer import train_bpe
    from service.runtime.tokenizer import Tokenizer

    shipped = HFTokenizer.from_file(str(SHIPPED_MODEL / "tokenizer.json"))
    if vocab_size <= shipped.get_vocab_size():
        return Tokenizer(truncated_bpe(shipped, vocab_size))
    hf = train_bpe(load_plays().values(), vocab_size=vocab_size, min_frequency=1)
    reserved = [AddedToken(f"<reserved_{i}>", special=False, normalized=False)
                for i in range(hf.get_vocab_size(), vocab_size)]
    hf.add_tokens(reserved)
    if hf.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE has {hf.get_vocab_size()} ids, not {vocab_size}")
    return Tokenizer(hf)


def truncated_bpe(tokenizer, vocab_size: int):
    """The BPE's first `vocab_size` ids: its special tokens, byte alphabet and first merges (what training
    stopped earlier gives, since BPE training adds one merge at a time)."""
    from tokenizers import Tokenizer as HFTokenizer

    data = json.loads(tokenizer.to_str())
    vocab = {t: i for t, i in data["model"]["vocab"].items() if i < vocab_size}
    merges = [m for m in data["model"]["merges"] if "".join(m if isinstance(m, list) else m.split(" ")) in vocab]
    first = len(vocab) - len(merges)  # the id of the first merge's token
    if any(vocab["".join(m if isinstance(m, list) else m.split(" "))] != first + k for k, m in enumerate(merges)):
        raise ValueError("the BPE's merge tokens are not numbered in merge order; it cannot be truncated")
    data["model"]["vocab"], data["model"]["merges"] = vocab, merges
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < vocab_size]
    return HFTokenizer.from_str(json.dumps(data))


def read_stamp(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
