"""`attnserve bench rotary-placement`: rotary positions inside GroupQueryAttention (do_rotary) or as
RotaryEmbedding ops before it, in the static-cache graph of a Llama-family model of a real shape.

    attnserve bench rotary-placement                 # SmolLM2-135M's blocks, vocabulary 8192, context 512
    attnserve bench rotary-placement --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 \\
        --steps 2 --rounds 1 --no-write                                             # seconds

Both graphs come from one random-weight model and are first checked against PyTorch (`verify_static`);
then decode steps are timed at batch 1 and 32, the rounds interleaved, medians reported.
Writes docs/bench/rotary_placement.json (or into --out) and its section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown

SHAPE = dict(layers=30, heads=9, kv_heads=3, hidden=576, intermediate=1536, vocab=8192, context=512)
PLACEMENTS = {"RotaryEmbedding ops": False, "inside GroupQueryAttention": True}


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench rotary-placement", description=__doc__.split("\n\n")[0])
    for name, default in SHAPE.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--steps", type=int, default=12, help="decode steps per timing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    from export.static_cache_graph import export_static_cache_decoder
    from export.verify import verify_static
    from model.config import GPTConfig
    from model.gpt import GPT
    from service.runtime.graph_choice import decode_step_ms
    from service.runtime.static_runner import StaticRunner

    config = GPTConfig(vocab_size=args.vocab, n_ctx=args.context, n_layer=args.layers, n_head=args.heads,
                       n_kv_head=args.kv_heads, d_model=args.hidden, d_ff=args.intermediate, pos_encoding="rotary",
                       norm="rmsnorm", mlp="swiglu", bias=False)
    model = GPT(config).eval()
    times: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runners = {}
        for name, inside in PLACEMENTS.items():
            bundle = Path(tmp) / str(inside)
            _bundle_of(model, bundle)
            export_static_cache_decoder(model, bundle / "model.static.onnx", rotary_in_attention=inside)
            assert verify_static(model, bundle, "static").passed, f"{name}: the graph differs from PyTorch"
            runners[name] = StaticRunner(bundle, "static", provider="cpu")
        for _ in range(args.rounds):
            for name, runner in runners.items():
                for batch in (1, 32):
                    times.setdefault((name, batch), []).extend(decode_step_ms(runner, batch, args.steps))
    rows = [{"placement": name, "batch": batch, "step_ms": statistics.median(ts)}
            for (name, batch), ts in times.items()]
    for row in rows:
        print(f"{row['placement']:<28} batch {row['batch']:>2}: {row['step_ms']:7.2f} ms/step")
    result = {"machine": describe(), "shape": {k: getattr(args, k) for k in SHAPE}, "rows": rows}
    md = render(result, argv)
    print(md)
    if not args.no_write:
        publish("rotary_placement", result, md, args.out)
    return 0


def _bundle_of(model, bundle: Path) -> None:
    """A bundle directory around the model's static graph (the default model's tokenizer)."""
    import shutil

    from export.bundle_writer import make_manifest
    from service.engine.config import DEFAULT_BUNDLE
    from service.runtime.bundle import write_manifest

    bundle.mkdir(parents=True)
    shutil.copyfile(DEFAULT_BUNDLE / "tokenizer.json", bundle / "tokenizer.json")
    write_manifest(bundle, make_manifest(model.config, {}, "rotary", 17, "-", ["static"], "static"))


def render(r: dict, argv: list[str] | None) -> str:
    s = r["shape"]
    cmd = shown("attnserve bench rotary-placement" + (" " + " ".join(argv) if argv else ""))
    lines = ["## Rotary positions: inside the attention op, or before it", "",
             f"`{cmd}` on {machine_line(r['machine'])}.", "",
             f"A random Llama-style model: {s['layers']} layers, {s['heads']} heads, {s['kv_heads']} KV heads, hidden "
             f"{s['hidden']}, intermediate {s['intermediate']}, vocabulary {s['vocab']}, context {s['context']}. Both "
             "graphs pass `verify_static` against PyTorch first; decode steps after a 16-token prompt, rounds "
             "interleaved, medians.", "", "| rotary | batch | ms/step |", "|---|---|---|"]
    lines += [f"| {row['placement']} | {row['batch']} | {row['step_ms']:.2f} |" for row in r["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
