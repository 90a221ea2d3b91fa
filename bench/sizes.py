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

Each size is an attnserve model directory, the same weights as a Hugging Face directory
(`attnserve export-hf`: config.json with n_ctx for GPT-2, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json), and a bundle with the serving graphs "static" (fp32,
checked against PyTorch with `export.verify.verify_static`), "static-int8", and "static-int4" when
`export_bundle` can write it. `prepare` builds them under `work/<size>/` once and reuses them while
the stamp `work/<size>/prepared.json` matches what would be built.

Random weights. At the usual initialisation (std 0.02 everywhere) a random model with a tied head
repeats itself under greedy decoding: the last token's embedding dominates the final residual
stream, and its dot product with itself (or a near neighbour's) wins; greedy output cycles through
2-3 tokens. Here every matrix is drawn with std 1/sqrt(fan_in), so each residual branch adds about as
much to the stream as the embedding; the embeddings (also the output head) have norm EMBEDDING_NORM,
so the logits have a standard deviation of about 4; and the query and key weights are QK_GAIN times
larger, so attention picks out a few positions and the next token depends on the context, not on the
last token alone. Sharper attention is livelier but amplifies rounding, so the 30-layer model gets a
smaller gain than the 12-layer one. Biases are N(0, 0.02²); norm gains stay 1. Seeds are fixed.

`liveliness` checks it: greedy decoding of 4 random 16-token prompts, 128 new tokens each, on the
PyTorch model (seed 0; the fp32 error is PyTorch fp32 against float64 over 2 x 144 positions):

    size           QK_GAIN  distinct tokens per row (of 128)  mean top-1 margin  fp32 error (max / mean)
    gpt2-124m      2.5      89, 96, 90, 86                    1.12               5.7e-4 / 4.6e-5
    smollm2-135m   1.5      91, 45, 80, 76                    1.06               1.6e-4 / 1.3e-5
    shipped        trained  39, 34, 28, 59                    1.88

(at 124M a gain of 2.0 gives 11-45 distinct tokens, 3.0 gives 105-114 with 3x the error; at 135M,
2.5 gives 120-127 with a mean error of 7e-4, 50 times the 1.5's). So the fp32 engines' greedy
choices differ only where a margin is within rounding, which is rare. `prepare` refuses a random model
with fewer than MIN_DISTINCT distinct tokens in any row.

Quantised graphs are another matter: the context sensitivity that keeps these models lively also
amplifies quantisation error. Teacher-forced along a fp32 greedy continuation (2 rows of 16 + 112
tokens), static-int8 picks the fp32 top-1 token at 27% of the positions at 124M and 68% at 135M,
static-int4 at 4.5% and 18%; the trained shipped model's at 97% and 90%. The random sizes measure
speed and fp32 agreement; the quality of quantised graphs is measured on the shipped model.

Tokenizers. The random models need a tokenizer with their exact vocabulary for the peers to load.
It is a standard GPT-2-style byte-level BPE (GPT-2's pre-tokenizer, `<|endoftext|>` = id 0) trained
with Hugging Face `tokenizers` on the whole Shakespeare corpus (`model.data`); the trainer stops at
47,854 tokens, when every word of the corpus is one token, so the ids above that are reserved
tokens `<reserved_N>` (added, not special: they encode and decode as their text). A vocabulary no
larger than the shipped model's (the tests' tiny shapes) is the shipped BPE truncated, which is the
BPE the trainer would have stopped at.
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.llama_shape import SMOLLM2_135M
from bench.quantization import GPT2_SHAPE
from service.runtime.bundle import sha256_file

SIZES = ("shipped", "gpt2-124m", "smollm2-135m")
ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = ROOT / "models" / "shakespeare"
STAMP = "prepared.json"
RECIPE = 1  # bumped when the weights, the tokenizer or the bundle of a size would change; the stamp records it

SEED = 0
# norm of a random model's token and position embeddings (std EMBEDDING_NORM / sqrt(d_model)); through the tied
# head, the std of its logits
EMBEDDING_NORM = 4.0
# query and key weights QK_GAIN / sqrt(fan_in): attention scores of std about QK_GAIN². Sharper attention makes
# the output depend on the context (below 2.5 the 12-layer GPT falls into short loops), but it also amplifies
# rounding (at 2.5 the 30-layer Llama's fp32 logits are 7e-4 from float64 on average), so the deeper model gets less
QK_GAIN = {"gpt2-124m": 2.5, "smollm2-135m": 1.5}
# max |Δlogits| of a random model's fp32 serving graph against PyTorch: fp32 rounding, amplified by the sharp
# attention (PyTorch fp32 against float64, logits of std 4: 5.7e-4 at most at 124M, 1.6e-4 at 135M)
VERIFY_TOL = 2e-3
BIAS_STD = 0.02
MIN_DISTINCT = 16  # fewest distinct tokens a random model must produce in 128 greedy ones, in every row

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
    bundle: Path  # ONNX bundle: graphs "static" (fp32), "static-int8", and "static-int4" when export supports it
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
    want = {"size": size, "recipe": RECIPE, "seed": SEED, "qk_gain": qk_gain or QK_GAIN.get(size),
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
    from model.export_hf import export_hf

    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    if size != "shipped":
        save_model_dir(random_model(config, want["qk_gain"]), bpe_tokenizer(config.vocab_size), model_dir,
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
    from export.cli import export_bundle

    return "int4" in inspect.signature(export_bundle).parameters


def write_bundle(model_dir: Path, out: Path, name: str, int4: bool) -> list[str]:
    """The serving graphs: static (fp32), static-int8, static-int4 when asked (the standard fp32 graph is
    left out; its INT8 form stays, as `export --int8 --no-fp32` writes)."""
    from export.cli import export_bundle

    extra = {"int4": True} if int4 else {}
    return export_bundle(model_dir, out, name=name, int8=True, keep_fp32=False, **extra)


def random_model(config, qk_gain: float, seed: int = SEED):
    """A GPT of `config` with lively random weights (see the module docstring), in eval mode."""
    import torch

    from model.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(config).eval()
    gen = torch.Generator().manual_seed(seed)
    queries_and_keys = config.d_model + config.kv_heads * config.d_head  # the first rows of qkv_proj
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is tok_emb.weight, listed once
            if name in ("tok_emb.weight", "pos_emb.weight", "lm_head.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * EMBEDDING_NORM / math.sqrt(config.d_model))
            elif p.dim() == 2:  # a Linear weight, (out, in)
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
                if name.endswith("qkv_proj.weight"):
                    p[:queries_and_keys] *= qk_gain
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
    return model


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

    from model.data import load_plays
    from model.tokenizer import train_bpe
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
