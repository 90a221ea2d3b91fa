"""CTranslate2 and transformers as peers of `attnserve bench g2p`, each in its own virtualenv.

    .venv-ct2/bin/python bench/peers/seq2seq_peer.py --system ctranslate2 --precision int8 \
        --hf-dir H --model-dir M --convert                      # ct2-transformers-converter, once
    .venv-ct2/bin/python bench/peers/seq2seq_peer.py --system ctranslate2 --precision int8 \
        --hf-dir H --model-dir M --spec spec.json               # prints the result
    .venv-peers/bin/python bench/peers/seq2seq_peer.py --system transformers --hf-dir H --spec spec.json

Spec:   {"sources": [[ids]], "source_tokens": [[token strings]], "vocab": [token strings by id],
         "alone": K, "concurrency": C, "max_new": N, "repeats": R}
Result: {"system", "precision", "settings", "versions", "alone_words_per_s": [per repeat],
         "concurrent_words_per_s": [per repeat], "outputs": [[target ids, EOS dropped]], "peak_rss_bytes"}

Alone: the first K sources one after another. Concurrent: every source, C at a time: CTranslate2's
`translate_batch(max_batch_size=C)` (it has no continuous batching; batching is its documented way to
serve many requests, and it orders each batch by length itself), transformers' `generate` on padded
batches of C. Greedy (beam 1), or beam search of the spec's `beam` width, to EOS or N tokens, from the
model's decoder start token.
CTranslate2 runs `ct2-transformers-converter` on the `attnserve export-hf` BART directory, unchanged;
intra_threads = the cores, inter_threads = 1 (one batch at a time holds the cores). transformers runs
fp32 in PyTorch with torch's default threads (one per core).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from protocol import emit, peak_rss_bytes

QUANTIZATION = {"fp32": "float32", "int8": "int8"}


def cores() -> int:
    return len(os.sched_getaffinity(0))


class CTranslate2:
    def __init__(self, model_dir: Path, precision: str, spec: dict):
        import ctranslate2

        self.translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type=QUANTIZATION[precision],
                                                 intra_threads=cores(), inter_threads=1)
        self.ids = {token: i for i, token in enumerate(spec["vocab"])}
        self.max_new = spec["max_new"]
        self.beam = spec.get("beam", 1)
        self.settings = {"compute_type": QUANTIZATION[precision], "intra_threads": cores(), "inter_threads": 1,
                         "alone": "translate_batch of one source", "concurrent": "translate_batch, max_batch_size=C",
                         "decoding": f"beam_size={self.beam}", "converter": f"ct2-transformers-converter "
                                                                            f"--quantization {QUANTIZATION[precision]}"}

    def run(self, sources: list[list[str]], batch: int) -> list[list[int]]:
        results = self.translator.translate_batch(sources, max_batch_size=batch, beam_size=self.beam,
                                                  max_decoding_length=self.max_new)
        return [[self.ids[t] for t in r.hypotheses[0]] for r in results]


class Transformers:
    def __init__(self, hf_dir: str, spec: dict):
        import torch
        from transformers import BartForConditionalGeneration

        self.torch = torch
        self.model = BartForConditionalGeneration.from_pretrained(hf_dir).eval()
        c = self.model.config
        self.pad, self.eos, self.start = c.pad_token_id, c.eos_token_id, c.decoder_start_token_id
        self.max_new = spec["max_new"]
        self.beam = spec.get("beam", 1)
        self.settings = {"dtype": "float32", "threads": torch.get_num_threads(),
                         "alone": "generate on one source", "concurrent": "generate on padded batches of C",
                         "decoding": f"num_beams={self.beam}, do_sample=False"}

    def run(self, sources: list[list[int]], batch: int) -> list[list[int]]:
        out = []
        for at in range(0, len(sources), batch):
            rows = sources[at:at + batch]
            width = max(map(len, rows))
            ids = self.torch.tensor([r + [self.pad] * (width - len(r)) for r in rows])
            with self.torch.no_grad():
                gen = self.model.generate(input_ids=ids, attention_mask=(ids != self.pad).long(), do_sample=False,
                                          num_beams=self.beam, max_new_tokens=self.max_new, min_length=0,
                                          decoder_start_token_id=self.start, forced_bos_token_id=None,
                                          forced_eos_token_id=None)
            out += [row[1:] for row in gen.tolist()]
        return out


def strip(row: list[int], eos: int, pad: int) -> list[int]:
    """A target without its EOS and whatever padding follows."""
    row = row[:row.index(eos)] if eos in row else row
    return [t for t in row if t != pad]


def measure(run, sources: list, spec: dict) -> dict:
    k, c = spec["alone"], spec["concurrency"]
    outputs = run(sources, c)  # warm-up, and the outputs compared
    alone, concurrent = [], []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        for src in sources[:k]:
            run([src], 1)
        alone.append(k / (time.perf_counter() - start))
        start = time.perf_counter()
        run(sources, c)
        concurrent.append(len(sources) / (time.perf_counter() - start))
    return {"alone_words_per_s": alone, "concurrent_words_per_s": concurrent, "outputs": outputs}


def versions(system: str) -> dict:
    from importlib.metadata import version

    names = ["ctranslate2"] if system == "ctranslate2" else ["transformers", "torch"]
    return {**{n: version(n) for n in names}, "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("ctranslate2", "transformers"), required=True)
    p.add_argument("--precision", choices=sorted(QUANTIZATION), default="fp32")
    p.add_argument("--hf-dir", required=True, help="the BART directory of `attnserve export-hf`")
    p.add_argument("--model-dir", type=Path, help="CTranslate2's converted model")
    p.add_argument("--convert", action="store_true", help="convert into --model-dir and exit")
    p.add_argument("--spec")
    args = p.parse_args(argv)
    if args.convert:
        converter = Path(sys.executable).with_name("ct2-transformers-converter")
        subprocess.run([str(converter), "--model", args.hf_dir, "--output_dir", str(args.model_dir),
                        "--quantization", QUANTIZATION[args.precision], "--force"], check=True, stdout=sys.stderr)
        return 0
    spec = json.loads(Path(args.spec).read_text())
    if args.system == "ctranslate2":
        peer = CTranslate2(args.model_dir, args.precision, spec)
        eos, pad = peer.ids.get("</s>", -1), -1
        result = measure(peer.run, spec["source_tokens"], spec)
    else:
        peer = Transformers(args.hf_dir, spec)
        eos, pad = peer.eos, peer.pad
        result = measure(peer.run, spec["sources"], spec)
    result["outputs"] = [strip(row, eos, pad) for row in result["outputs"]]
    name = "CTranslate2" if args.system == "ctranslate2" else "transformers"
    emit({"system": name, "precision": args.precision, "settings": peer.settings, "versions": versions(args.system),
          **result, "peak_rss_bytes": peak_rss_bytes()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
