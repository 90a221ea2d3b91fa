"""CTranslate2 as a peer of `attnserve bench compare` (peer protocol, in .venv-ct2).

    .venv-ct2/bin/python bench/peers/ctranslate2_peer.py --hf-dir runs/hf --model-dir runs/ct2-int8 \
        --precision int8 --convert          # ct2-transformers-converter, once
    .venv-ct2/bin/python bench/peers/ctranslate2_peer.py --hf-dir runs/hf --model-dir runs/ct2-int8 \
        --precision int8 --spec spec.json   # prints the result

**Conversion.** CTranslate2's own `ct2-transformers-converter --model <hf dir> --output_dir <dir>
--quantization float32|int8` on the `attnserve export-hf` directory (GPT2LMHeadModel or
LlamaForCausalLM, both supported by its converter), unchanged. The weights are stored at the precision
they run at, so the process holds only those.

**Settings.** `ctranslate2.Generator(dir, device="cpu", compute_type=float32|int8, intra_threads=cores,
inter_threads=1)`: the documented CPU advice is intra_threads = the cores for one batch at a time (more
inter_threads split the cores between batches that run in parallel, and here one batch holds all the
work). int8 is CTranslate2's int8 GEMM: weights quantized per row at conversion, activations quantized
on the fly. Greedy: `sampling_topk=1`, `beam_size=1`, no repetition penalty, and `min_length = max_length`
so that the end-of-text id is masked until the N-th token (as transformers' min_new_tokens does).

**What is timed.** Batch 1: `generate_tokens` (the streaming API) per prompt; TTFT = the first token it
yields. The 32 streams: one static `generate_batch` of the 32 prompts (CTranslate2 has no continuous
batching; its documented way to serve many sequences is to batch them) with a per-token `callback`,
which gives each row's first token time. Prompts are passed as token strings (the tokenizer's
`convert_ids_to_tokens`; CTranslate2's vocabulary is the tokenizer's, in id order) and results are read
back as `sequences_ids`. A batch-1 prompt's ids alone are those `generate_tokens` streamed (CTranslate2
runs it as a batch of one through the same decoding as `generate_batch`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from protocol import Recorder, emit, read_spec

QUANTIZATION = {"fp32": "float32", "int8": "int8"}


def convert(hf_dir: str, model_dir: Path, precision: str) -> None:
    converter = Path(sys.executable).with_name("ct2-transformers-converter")
    subprocess.run([str(converter), "--model", hf_dir, "--output_dir", str(model_dir), "--quantization",
                    QUANTIZATION[precision], "--force"], check=True, stdout=sys.stderr)


def cores() -> int:
    return len(os.sched_getaffinity(0))


class Peer:
    def __init__(self, hf_dir: str, model_dir: Path, precision: str):
        import ctranslate2
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.settings = {"compute_type": QUANTIZATION[precision], "intra_threads": cores(), "inter_threads": 1,
                         "device": "cpu", "single": "generate_tokens (streamed), one prompt at a time",
                         "streams": "generate_batch of 32 with a per-token callback (static batch)",
                         "greedy": "sampling_topk=1, beam_size=1, min_length = max_length",
                         "converter": f"ct2-transformers-converter --quantization {QUANTIZATION[precision]}"}
        self.generator = ctranslate2.Generator(str(model_dir), device="cpu", compute_type=QUANTIZATION[precision],
                                               intra_threads=cores(), inter_threads=1)

    def tokens(self, prompt: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(prompt)

    def options(self, new_tokens: int) -> dict:
        return dict(max_length=new_tokens, min_length=new_tokens, sampling_topk=1, include_prompt_in_result=False)

    def stream_one(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """(new ids, seconds to the last token, seconds to the first) through generate_tokens."""
        ids = []
        start = time.perf_counter()
        first = None
        for step in self.generator.generate_tokens(self.tokens(prompt), max_length=new_tokens,
                                                   min_length=new_tokens, sampling_topk=1):
            if first is None:
                first = time.perf_counter() - start
            ids.append(step.token_id)
        return ids, time.perf_counter() - start, first

    def batch(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, list[float]]:
        """(new ids per row, seconds to the last token, each row's seconds to its first) through generate_batch."""
        firsts: dict[int, float] = {}
        start = time.perf_counter()

        def callback(step) -> bool:
            if step.batch_id not in firsts:
                firsts[step.batch_id] = time.perf_counter() - start
            return False  # never stop early

        results = self.generator.generate_batch([self.tokens(p) for p in prompts], callback=callback,
                                                **self.options(new_tokens))
        elapsed = time.perf_counter() - start
        return [r.sequences_ids[0] for r in results], elapsed, [firsts[i] for i in range(len(prompts))]


def measure(peer: Peer, spec: dict) -> tuple[Recorder, list[list[int]]]:
    new = spec["new_tokens"]
    rec = Recorder(spec)
    peer.stream_one(spec["single"][0], new)  # warm-up of both paths
    tokens, _, _ = peer.batch(spec["streams"], new)
    for row in tokens:
        if len(row) != new:
            raise SystemExit(f"CTranslate2 generated {len(row)} tokens, expected {new}")
    for _ in range(spec["repeats"]):
        times, ttfts, alone = [], [], []
        for prompt in spec["single"]:
            ids, seconds, ttft = peer.stream_one(prompt, new)
            if len(ids) != new:
                raise SystemExit(f"CTranslate2 streamed {len(ids)} tokens, expected {new}")
            times.append(seconds)
            ttfts.append(ttft)
            alone.append(ids)
        rec.add_single(times, ttfts, alone)
        _, seconds, firsts = peer.batch(spec["streams"], new)
        rec.add_streams(seconds, firsts)
    return rec, tokens


def versions() -> dict:
    from importlib.metadata import version

    return {"ctranslate2": version("ctranslate2"), "transformers": version("transformers"),
            "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--model-dir", type=Path, required=True, help="the converted model")
    p.add_argument("--precision", choices=sorted(QUANTIZATION), default="fp32")
    p.add_argument("--convert", action="store_true", help="convert into --model-dir and exit")
    p.add_argument("--spec", help="the run spec (peer protocol)")
    args = p.parse_args(argv)
    if args.convert:
        convert(args.hf_dir, args.model_dir, args.precision)
        return 0
    if not args.spec:
        p.error("--spec or --convert")
    spec = read_spec(args.spec)
    peer = Peer(args.hf_dir, args.model_dir, args.precision)
    rec, tokens = measure(peer, spec)
    emit(rec.result("CTranslate2", args.precision, peer.settings, versions(), tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
