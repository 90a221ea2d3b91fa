"""`attnserve bench g2p`: the encoder-decoder served by attnserve against CTranslate2 and transformers on
the same weights: words per second alone and with 32 concurrent requests, and the words they get right.

    attnserve bench g2p                               # the shipped G2P model, 512 held-out words, 3 rounds
    attnserve bench g2p --words 64 --rounds 1 --no-write

The model directory (default models/g2p-cmudict) is written as a BART directory by `attnserve export-hf`
(the G2P model is post-LN with an embedding norm and one shared embedding, which BART expresses; its
sinusoidal positions become BART's position table). CTranslate2 converts that directory with its own
`ct2-transformers-converter` (float32 and int8, in .venv-ct2), transformers loads it as a
`BartForConditionalGeneration` (in .venv-peers); attnserve serves the bundle (default
models/g2p-cmudict-onnx): in-process its fp32 pair and, when the bundle has it, its INT8 pair, and over
gRPC the INT8 pair (the fp32 one without it). Every system runs in a process of its own
(`bench/peers/seq2seq_peer.py`, `bench/peers/seq2seq_attnserve.py`) on the same source ids, greedy, to
EOS or 35 tokens (the model's longest target); the rounds go over every system in turn, rotated, so a
noisy machine slows them alike. With `--beam K` (default 4) every system runs a second time with beam search of
width K (CTranslate2's `beam_size`, transformers' `num_beams`, attnserve's `beam_width`): its rows are
named "... beam K", and "same as" compares them with transformers' beam output instead of PyTorch's greedy.

The words are a fixed sample of the held-out test words. Alone: the first 64 of them one after another.
Concurrent: all of them, 32 at a time. Reported per system: the medians of words/s over the rounds, how
many words its output equals PyTorch's greedy output on, the WER of its output against the dictionary,
and its peak RSS. Writes docs/bench/g2p.json and the g2p section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "g2p-cmudict"
BUNDLE = ROOT / "models" / "g2p-cmudict-onnx"
PEER = ROOT / "bench" / "peers" / "seq2seq_peer.py"
CT2, PEERS = ROOT / ".venv-ct2" / "bin" / "python", ROOT / ".venv-peers" / "bin" / "python"
SYSTEMS = ("attnserve in-process fp32", "attnserve in-process int8", "attnserve gRPC int8", "attnserve gRPC fp32",
           "CTranslate2 fp32", "CTranslate2 int8", "transformers fp32")
ALONE, CONCURRENCY, MAX_NEW = 64, 32, 35


def make_spec(model_dir: Path, words: int, seed: int) -> tuple[dict, dict]:
    """(the spec every system runs, the test words' references)."""
    from model.training import g2p_data as data
    from service.runtime.tokenizer import Tokenizer

    test = data.split_words(data.load_cmudict()).test
    chosen = random.Random(seed).sample(sorted(test), min(words, len(test)))
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.json", eos_id=config["eos_token_id"])
    sources = [tokenizer.encode(w) for w in chosen]
    vocab = [tokenizer.hf.id_to_token(i) for i in range(tokenizer.vocab_size)]
    spec = {"words": chosen, "sources": sources, "source_tokens": [[vocab[i] for i in s] for s in sources],
            "vocab": vocab, "alone": min(ALONE, len(sources)), "concurrency": CONCURRENCY,
            "max_new": min(MAX_NEW, config["n_tgt_ctx"] - 1)}
    return spec, {w: test[w] for w in chosen}


def reference(model_dir: Path, spec: dict) -> list[list[int]]:
    """PyTorch's greedy targets (EOS dropped)."""
    import torch

    from model.checkpoint import load_seq2seq_dir

    model, _ = load_seq2seq_dir(model_dir)
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    out = []
    for at in range(0, len(spec["sources"]), 256):
        rows = spec["sources"][at:at + 256]
        width = max(map(len, rows))
        src = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        out += [[t for t in row if t != eos] for row in model.generate(src, (src != pad).long(), spec["max_new"])]
    return out


def prepare(work: Path, model_dir: Path) -> tuple[dict[str, list[str] | None], str]:
    """The BART directory and CTranslate2's conversions: each peer's command (None: not installed, or the
    model is not one BART can express; the reason is returned with them)."""
    from model.hf.bart import Unsupported
    from model.hf.export_hf import export_hf

    hf = work / "hf"
    try:
        export_hf(model_dir, hf)
    except Unsupported as e:
        return {}, f"the peers read the model as BART: {e}"
    commands: dict[str, list[str] | None] = {}
    for precision in ("fp32", "int8"):
        ct2 = work / f"ct2-{precision}"
        base = [str(CT2), str(PEER), "--system", "ctranslate2", "--precision", precision, "--hf-dir", str(hf),
                "--model-dir", str(ct2)]
        if CT2.exists():
            subprocess.run([*base, "--convert"], check=True, stdout=subprocess.DEVNULL)
        commands[f"CTranslate2 {precision}"] = base if CT2.exists() else None
    commands["transformers fp32"] = ([str(PEERS), str(PEER), "--system", "transformers", "--hf-dir", str(hf)]
                                     if PEERS.exists() else None)
    return commands, "not installed (make bench-peers)"


def attnserve_commands(bundle: Path) -> dict[str, list[str]]:
    """In-process: every pair of the bundle; over gRPC: the INT8 pair, or the fp32 one without it."""
    from service.runtime.bundle import read_manifest

    ours = [sys.executable, "-m", "bench.peers.seq2seq_attnserve", "--bundle", str(bundle)]
    int8 = "static-int8" in read_manifest(bundle).graphs
    commands = {"attnserve in-process fp32": [*ours, "--mode", "in-process", "--graph", "static"]}
    if int8:
        commands["attnserve in-process int8"] = [*ours, "--mode", "in-process", "--graph", "static-int8"]
        commands["attnserve gRPC int8"] = [*ours, "--mode", "grpc", "--graph", "static-int8"]
    else:
        commands["attnserve gRPC fp32"] = [*ours, "--mode", "grpc", "--graph", "static"]
    return commands


def why_not(name: str, peers_why: str) -> str:
    if name.startswith("attnserve"):
        return "the bundle has no INT8 pair (attnserve export --int8)"
    return peers_why


def run(cmd: list[str], spec_path: Path) -> dict:
    done = subprocess.run([*cmd, "--spec", str(spec_path)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(results: list[dict], words: list[str], refs: dict, reference_out: list[list[int]] | None,
              vocab: list[str], name: str) -> dict:
    from model.training import g2p_data as data

    first = results[0]
    outputs = first["outputs"]
    predictions = {w: tuple(vocab[i] for i in row if vocab[i] in data.PHONEMES)
                   for w, row in zip(words, outputs, strict=True)}
    scores = data.score(predictions, refs)
    return {"system": name, "precision": first["precision"], "settings": first["settings"],
            "versions": first["versions"],
            "alone_words_per_s": statistics.median(x for r in results for x in r["alone_words_per_s"]),
            "concurrent_words_per_s": statistics.median(x for r in results for x in r["concurrent_words_per_s"]),
            "same_as_reference": None if reference_out is None else sum(
                a == b for a, b in zip(outputs, reference_out, strict=True)),
            "wer": scores.wer, "per": scores.per,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results)}


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench g2p", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=MODEL, help="the G2P model directory (PyTorch, for the peers)")
    p.add_argument("--bundle", type=Path, default=BUNDLE, help="its ONNX bundle (attnserve)")
    p.add_argument("--words", type=int, default=512, help="held-out words; the first 64 also run alone")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "g2p-bench")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--beam", type=int, default=4, help="beam width of the beam search rows (1: greedy rows only)")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    spec, refs = make_spec(args.model, args.words, args.seed)
    spec["repeats"] = 1
    spec_path = args.work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    beam_path = args.work / "spec-beam.json"
    beam_path.write_text(json.dumps({**spec, "beam": args.beam}))
    torch_out = reference(args.model, spec)
    commands, why = prepare(args.work, args.model)
    commands |= attnserve_commands(args.bundle)
    grpc_row = next(name for name in commands if name.startswith("attnserve gRPC"))
    skipped = {name: why_not(name, why) for name in SYSTEMS
               if commands.get(name) is None and not (name.startswith("attnserve gRPC") and name != grpc_row)}
    for name, reason in skipped.items():
        print(f"  {name}: skipped: {reason}")
    systems = [name for name in SYSTEMS if commands.get(name) is not None]
    specs = dict.fromkeys(systems, spec_path)
    if args.beam > 1:
        beams = {f"{name} beam {args.beam}": name for name in systems}
        commands |= {b: commands[name] for b, name in beams.items()}
        specs |= dict.fromkeys(beams, beam_path)
        systems += list(beams)
    results: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(args.rounds):
        print(f"  round {r + 1}/{args.rounds}")
        for name in systems[r % len(systems):] + systems[:r % len(systems)]:
            results[name].append(run(commands[name], specs[name]))
            last = results[name][-1]
            print(f"    {name:<22} alone {statistics.median(last['alone_words_per_s']):7.1f} words/s   "
                  f"{CONCURRENCY} at a time {statistics.median(last['concurrent_words_per_s']):7.1f} words/s")
    beam_reference = next((results[n][0]["outputs"] for n in systems if n.startswith("transformers") and " beam " in n),
                          None)
    rows = [summarize(results[n], spec["words"], refs, beam_reference if " beam " in n else torch_out, spec["vocab"],
                      n) for n in systems]
    result = {"machine": describe(), "argv": argv if argv is not None else sys.argv[1:], "words": len(spec["words"]),
              "alone": spec["alone"], "concurrency": CONCURRENCY, "rounds": args.rounds, "rows": rows,
              "skipped": skipped}
    md = render(result)
    print(md)
    if not args.no_write:
        publish("g2p", result, md, args.out)
    return 0


def render(r: dict) -> str:
    m = r["machine"]
    argv = shown(" ".join(r["argv"]))
    lines = [f"`attnserve bench g2p{' ' + argv if argv else ''}` on {machine_line(m)}: {r['words']} held-out words "
             f"(the first {r['alone']} also alone), {r['rounds']} interleaved rounds, medians.", "",
             f"| system | alone, words/s | {r['concurrency']} at a time, words/s | same as PyTorch greedy "
             "(beam rows: transformers' beams) | WER | PER | peak RSS |", "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        same = "—" if row["same_as_reference"] is None else f"{row['same_as_reference']}/{r['words']}"
        lines.append(f"| {row['system']} | {row['alone_words_per_s']:.0f} | "
                     f"{row['concurrent_words_per_s']:.0f} | {same} | "
                     f"{row['wer']:.1%} | {row['per']:.2%} | {row['peak_rss_bytes'] / 2**20:.0f} MiB |")
    lines += ["", "Settings:"]
    lines += [f"- {row['system']} ({', '.join(f'{k} {v}' for k, v in row['versions'].items())}): "
              + "; ".join(f"{k}: {shown(str(v))}" for k, v in row["settings"].items()) for row in r["rows"]]
    lines += [f"- skipped: {name}: {reason}" for name, reason in r["skipped"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
