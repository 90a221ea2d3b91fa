"""Random-weight models at real shapes, built once under ~/.cache/attnserve/real-shapes/<name>/, for the memory
and speed benchmarks of sizes where reading the weights is the cost.

    python -m bench.real_shapes build qwen2.5-0.5b llama-131k     # or: make real-shapes
    python -m bench.real_shapes path qwen2.5-0.5b                  # the bundle's path, once built
    python -m bench.real_shapes list

Each shape is built as a user would bring a checkpoint:

    <name>/hf          transformers' own class (Qwen2ForCausalLM, LlamaForCausalLM) at this shape, random weights
                       drawn as bench/sizes.py draws them (seeded), `save_pretrained` (safetensors), and a
                       byte-level BPE of exactly the vocabulary (bench/sizes.py: bpe_tokenizer)
    <name>/model       `attnserve import-hf <name>/hf -o <name>/model`
    <name>/bundle      `attnserve export <name>/model -o <name>/bundle` with EXPORT_FLAGS
    <name>/built.json  the stamp: what was built (recipe, shape, init) and each step's wall time and peak RSS

import-hf and export run as child processes of their own, so the stamp's peak RSS is theirs alone. A step
whose output the stamp records for the same recipe is not run again; anything else rebuilds the shape.
The shapes: qwen2.5-0.5b and qwen2.5-1.5b (Qwen2.5's widths, 32,768 positions), llama-3.2-1b (Llama 3.2 1B's
widths at 32,768 positions), and llama-131k (131,072 positions at tiny widths).
`build` with no names builds every shape. The largest, qwen2.5-1.5b (5.1 GiB of fp32 weights), peaked at
10.7 GiB in import-hf and 6.1 GiB in export (docs/BENCHMARKS.md#export-time-and-peak-memory-at-real-shapes):
look at the free memory first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.sizes import INIT, SEED, bpe_tokenizer, draw_lively_

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "attnserve" / "real-shapes"
STAMP = "built.json"
RECIPE = 1  # bumped when the weights or the tokenizer of a shape would change
EXPORT_REVISION = 2  # bumped when `attnserve export` writes different graphs: only the bundle is made again
VOCAB = 32_000  # the vocabulary of every shape (the reports these shapes reproduce used 32k)
# the Llama-family init of bench/sizes.py, chosen by its sweep at 30 layers (SmolLM2-135M's shape)
LLAMA_INIT = INIT["smollm2-135m"]
# the bundle: the serving graph in fp32, INT8 (per row) and INT4, and the standard graph in fp32 and INT8
EXPORT_FLAGS = ("--int8", "--int4")


@dataclass(frozen=True)
class RealShape:
    architecture: str  # the transformers class, as config.json's `architectures` names it
    config: dict  # its config's fields, beyond the vocabulary and the special ids


QWEN2 = dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True, use_sliding_window=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# Llama 3.x's rope: theta 500,000 and llama3 scaling of an 8192-position original
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES = {
    "qwen2.5-0.5b": RealShape("Qwen2ForCausalLM", dict(
        QWEN2, num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864)),
    "qwen2.5-1.5b": RealShape("Qwen2ForCausalLM", dict(
        QWEN2, num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960)),
    # Llama 3.2's positions (131,072, llama3 rope scaling of an 8192-position original) at tiny widths
    "llama-131k": RealShape("LlamaForCausalLM", dict(
        num_hidden_layers=16, hidden_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
        intermediate_size=1024, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters=LLAMA3_ROPE)),
    # Llama 3.2 1B's widths; 32,768 positions (not its 131,072): the context `attnserve bench compare
    # --real-shapes` serves it at, so that a server sizes its sequences by what the benchmark sends
    "llama-3.2-1b": RealShape("LlamaForCausalLM", dict(
        num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        intermediate_size=8192, rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=True,
        rope_parameters=LLAMA3_ROPE)),
}


@dataclass(frozen=True)
class Built:
    name: str  # one of SHAPES
    hf_dir: Path  # the transformers checkpoint
    model_dir: Path  # the attnserve model directory import-hf wrote
    bundle: Path  # the ONNX bundle export wrote


def paths(name: str, cache: Path = CACHE) -> Built:
    root = cache / name
    return Built(name=name, hf_dir=root / "hf", model_dir=root / "model", bundle=root / "bundle")


def build(name: str, cache: Path = CACHE) -> Built:
    """Build (or reuse) shape `name` under `cache`; returns its paths."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; the shapes are {sorted(SHAPES)}")
    built = paths(name, cache)
    root = built.hf_dir.parent
    want = {"name": name, "recipe": RECIPE, "seed": SEED, "init": asdict(LLAMA_INIT), **asdict(SHAPES[name]),
            "vocab_size": VOCAB, "export_flags": list(EXPORT_FLAGS)}
    stamp = read_stamp(root / STAMP)
    if {k: stamp.get(k) for k in want} != want:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        stamp = dict(want, steps={})
    steps = stamp["steps"]
    if "hf" not in steps:
        start = time.perf_counter()
        save_random_checkpoint(name, built.hf_dir)
        steps["hf"] = {"seconds": round(time.perf_counter() - start, 1)}
        write_stamp(root / STAMP, stamp)
    if "import" not in steps:
        shutil.rmtree(built.model_dir, ignore_errors=True)
        steps["import"] = run_step(["import-hf", str(built.hf_dir), "-o", str(built.model_dir)])
        write_stamp(root / STAMP, stamp)
    if steps.get("export", {}).get("revision") != EXPORT_REVISION:
        shutil.rmtree(built.bundle, ignore_errors=True)
        steps["export"] = run_step(["export", str(built.model_dir), "-o", str(built.bundle), "--name", name,
                                    *EXPORT_FLAGS])
        steps["export"]["revision"] = EXPORT_REVISION
        write_stamp(root / STAMP, stamp)
    return built


def state(name: str, cache: Path = CACHE) -> str:
    """'built', 'stale' (exported before the current EXPORT_REVISION: `build` exports it again) or 'not built'."""
    export = read_stamp(cache / name / STAMP).get("steps", {}).get("export")
    if export is None:
        return "not built"
    return "built" if export.get("revision") == EXPORT_REVISION else "stale"


def save_random_checkpoint(name: str, out: Path) -> None:
    """The shape's transformers model with lively random weights, saved as transformers saves it, and its tokenizer."""
    import torch
    import transformers

    shape = SHAPES[name]
    model_cls = getattr(transformers, shape.architecture)
    config = model_cls.config_class(vocab_size=VOCAB, eos_token_id=0, bos_token_id=0, pad_token_id=0,
                                    **shape.config)
    torch.manual_seed(SEED)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for param_name, p in model.named_parameters():  # a tied head is the embedding, listed once
            kind = hf_kind(param_name, p.dim())
            if kind:
                draw_lively_(p, kind, gen, config.hidden_size, hf_gain(param_name))
    model.save_pretrained(out)
    del model
    bpe_tokenizer(VOCAB).save(out / "tokenizer.json")


def hf_kind(name: str, dim: int) -> str | None:
    """How bench/sizes.py draws the Llama-family parameter `name`; None leaves it (a norm's gain)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "embedding"
    if dim == 2:
        return "matrix"
    return "bias" if name.endswith(".bias") else None


def hf_gain(name: str) -> float:
    """Queries and keys × qk_gain (sharper attention), the residual branches' outputs × branch_scale."""
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return LLAMA_INIT.qk_gain
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return LLAMA_INIT.branch_scale
    return 1.0


def run_step(args: list[str]) -> dict:
    """`attnserve <args>` as a child process (this checkout's code); its wall time and peak RSS."""
    command = [sys.executable, "-m", "attnserve", *args]
    print("$ attnserve " + " ".join(args), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"attnserve {' '.join(args)} failed (exit {os.waitstatus_to_exitcode(status)})")
    peak_mib = usage.ru_maxrss * 1024 / 2**20 if sys.platform != "darwin" else usage.ru_maxrss / 2**20
    print(f"  {seconds:.0f} s, peak RSS {peak_mib / 1024:.2f} GiB", flush=True)
    return {"command": "attnserve " + " ".join(args), "seconds": round(seconds, 1), "peak_rss_mib": round(peak_mib)}


def read_stamp(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def write_stamp(path: Path, stamp: dict) -> None:
    path.write_text(json.dumps(stamp, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.real_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["build", "path", "list"])
    p.add_argument("names", nargs="*", help=f"shapes: {', '.join(SHAPES)} (build: default all)")
    p.add_argument("--cache", type=Path, default=CACHE, help="where the shapes are built")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; the shapes are {sorted(SHAPES)}")
    if args.action == "list":
        for name in SHAPES:
            print(f"{name:<14} {state(name, args.cache):<10} {paths(name, args.cache).bundle}")
        return 0
    for name in args.names or (list(SHAPES) if args.action == "build" else []):
        print(build(name, args.cache).bundle if args.action == "build" else paths(name, args.cache).bundle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
