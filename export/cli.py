"""`attnserve export <model dir> -o <bundle dir>`: write, verify and derive an ONNX bundle.

    attnserve export models/shakespeare -o models/shakespeare-onnx --verify
    attnserve export models/shakespeare -o /tmp/bundle --optimize --int8 --int4 --fp16 --verify
    attnserve export models/shakespeare -o /tmp/bundle --int8 --kv-dtype int8 --kv-dtype float16

Every bundle holds the serving graph (`static`: a fixed KV buffer updated in place, the default)
and the standard graph with a Concat cache (`fp32`, or `optimized`), which other ONNX tools
understand.

Also runs as `python -m export`. Exits non-zero if verification fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnserve.arguments import HintingParser
from export.bundle_writer import GRAPH_FILES, export_bundle
from export.known_warnings import known_warnings_silenced
from export.onnx_export import DEFAULT_OPSET
from export.variants import INT4, node_count, quantization
from model.checkpoint import CONFIG_FILE, load_model_dir, load_seq2seq_dir
from model.seq2seq_config import is_seq2seq


def build_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="attnserve export", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path, help="model directory (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("-o", "--out", type=Path, required=True, help="bundle directory to write")
    p.add_argument("--name", help="model name reported by the server (default: the model directory's name)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    p.add_argument("--optimize", action="store_true", help="also write the standard graph with fusions applied")
    p.add_argument("--int8", action="store_true",
                   help="also write INT8 graphs (CPU; activations quantized per row, so batch-invariant; no saturation "
                        "on any x86-64 CPU)")
    p.add_argument("--int8-per-tensor", action="store_true",
                   help="also write static-int8-per-tensor, the serving graph with onnxruntime's dynamic INT8 (one "
                        "activation scale per batch: not batch-invariant, served only when named), for comparison")
    p.add_argument("--int4", action="store_true",
                   help="also write the 4-bit serving graph (CPU; exact integer products on every x86-64 CPU)")
    p.add_argument("--int4-block-size", type=int, choices=(16, 32, 64, 128), default=INT4.block_size,
                   help="weights sharing one scale in the 4-bit graph (default %(default)s; 16 is batch-invariant on "
                        "AVX2-only CPUs too, at more bytes per token: docs/onnx.md)"),
    p.add_argument("--fp16", action="store_true", help="also write the FP16 graph (CUDA)")
    p.add_argument("--kv-dtype", dest="kv_dtypes", action="append", choices=["float16", "int8"], default=[],
                   help="also write each serving graph with its KV cache in this type (repeatable): float16 halves "
                        "the cache, int8 quarters it (served with 'attnserve serve --kv-dtype'; docs/engine.md)")
    p.add_argument("--no-fp32", dest="keep_fp32", action="store_false",
                   help="leave out the standard fp32 graph (its fused or INT8 forms stay; smaller bundle)")
    p.add_argument("--verify", action="store_true", help="compare every fp32 graph with PyTorch")
    p.add_argument("--default", choices=sorted(GRAPH_FILES), default="static",
                   help="graph the server uses when none is asked for (default: static)")
    p.add_argument("--tol", type=float, default=1e-4, help="max |Δlogits| allowed by --verify")
    return p


def export_encoder_decoder(args: argparse.Namespace) -> int:
    """An encoder-decoder model directory: its fp32 encoder and decoder graphs, and with --int8 their INT8 pair."""
    from export.seq2seq_bundle import export_seq2seq_bundle

    asked = [flag for flag, on in (("--optimize", args.optimize), ("--int8-per-tensor", args.int8_per_tensor),
                                   ("--int4", args.int4), ("--fp16", args.fp16),
                                   ("--kv-dtype", bool(args.kv_dtypes))) if on]
    if asked or args.default != "static":
        print(f"attnserve export: {args.model_dir} is an encoder-decoder model, exported as its fp32 encoder and "
              f"decoder graphs (and with --int8 their INT8 pair); {' '.join(asked) or '--default'} applies to "
              "decoder-only models", file=sys.stderr)
        return 2
    for file in export_seq2seq_bundle(args.model_dir, args.out, name=args.name, int8=args.int8):
        print(f"wrote {args.out / file} ({node_count(args.out / file)} nodes)")
    if not args.verify:
        return 0
    from export.verify_seq2seq import verify_int8_pair, verify_seq2seq

    model, _ = load_seq2seq_dir(args.model_dir)
    report = verify_seq2seq(model, args.out, tol=args.tol)
    print(report.format())
    ok = report.passed
    if args.int8:
        report = verify_int8_pair(args.out)
        print(report.format())
        ok &= report.passed
    return 0 if ok else 1


@known_warnings_silenced()
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.model_dir / CONFIG_FILE).is_file() and is_seq2seq(args.model_dir / CONFIG_FILE):
        return export_encoder_decoder(args)
    variants = export_bundle(args.model_dir, args.out, name=args.name, opset=args.opset, optimized=args.optimize,
                             int8=args.int8, int8_per_tensor=args.int8_per_tensor,
                             int4=quantization(f"nbits4-int8-b{args.int4_block_size}") if args.int4 else None,
                             fp16=args.fp16,
                             keep_fp32=args.keep_fp32, default=args.default, kv_dtypes=tuple(args.kv_dtypes))
    for v in variants:
        print(f"wrote {args.out / GRAPH_FILES[v]} ({v}, {node_count(args.out / GRAPH_FILES[v])} nodes)")
    if not args.verify:
        return 0
    from export.verify import verify, verify_static
    from service.runtime.concat_runner import ConcatRunner

    model, _ = load_model_dir(args.model_dir)
    report = verify_static(model, args.out, "static", tol=args.tol)
    print(report.format())
    ok = report.passed
    for v in (v for v in variants if v in ("fp32", "optimized")):
        report = verify(model, ConcatRunner(args.out, graph=v, provider="cpu"), tol=args.tol)
        print(report.format())
        ok &= report.passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
