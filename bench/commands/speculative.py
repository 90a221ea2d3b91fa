"""`attnserve bench speculative`: prompt-lookup speculative decoding on the shipped model, and what a
verification costs.

- Verify cost: on the shipped model and GPT-2 124M's shape (random weights, `bench/sizes.py`), the time of
  a plain decode at 1 and 8 rows, and of verifying k + 1 tokens of one row (`StaticRunner.prefill` from
  the row's length, k = 1 .. 8), medians of `--rounds` interleaved rounds. At 8 rows speculation needs a
  call per row (onnxruntime's attention continues a cache with several tokens for one row at a time).
- Workloads, batch 1, greedy, `--new-tokens` each: "input-grounded" (a held-out passage of 60 tokens twice,
  then its first 20 again: the continuation is in the prompt) and "free" (the first 32 tokens of a held-out
  passage). Engine in-process, speculation off against `--speculative ngram`, each round running them in the
  order off, ngram, ngram, off: tokens/s, drafts proposed and kept, and whether the text is the same.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, ROOT, describe, machine_line, publish, shown

KS = range(1, 9)
WORKLOADS = ("input-grounded", "free")


def _median_ms(call, rounds: int) -> float:
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def verify_cost(bundle: Path, rounds: int) -> dict:
    from service.runtime.static_runner import StaticRunner

    runner = StaticRunner(bundle, "static", provider="cpu")
    out: dict = {"decode_ms": {}, "verify_ms": {}}
    with runner.scratch_cache(8, 64):
        zeros = {n: np.zeros(n, dtype=np.int64) for n in (1, 8)}
        samples: dict = {}
        for _ in range(rounds):
            for n in (1, 8):
                samples.setdefault(("decode", n), []).append(
                    _median_ms(lambda n=n: runner.decode(zeros[n], zeros[n] + 8), 3))
            for k in KS:
                samples.setdefault(("verify", k), []).append(
                    _median_ms(lambda k=k: runner.prefill(0, [1] * (k + 1), 8, every_position=True), 3))
    for (kind, x), v in samples.items():
        out[f"{kind}_ms"][str(x)] = statistics.median(v)
    return out


def prompts_of(tokenizer, workload: str, count: int, random_ids: bool = False) -> list[list[int]]:
    """Held-out text of the shipped model's corpus, or with `random_ids` random ids (any bundle)."""
    if random_ids:
        ids = np.random.default_rng(0).integers(1, tokenizer.vocab_size, 400 * count + 60).tolist()
    else:
        from model.training.data import load_corpus

        ids = tokenizer.encode("\n".join(load_corpus().val)[10_000:200_000])
    out = []
    width = 30 if random_ids else 60  # a passage's tokens (a tiny test bundle has a short context)
    for i in range(count):
        passage = ids[i * 400:i * 400 + width]
        out.append(passage + passage + passage[:width // 3] if workload == "input-grounded" else passage[:32])
    return out


def workload_runs(bundle: Path, new_tokens: int, prompts: int, rounds: int, k: int, random_ids: bool = False) -> dict:
    from service.engine.config import EngineConfig
    from service.engine.core import Engine
    from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria

    engines = {mode: Engine(EngineConfig(bundle=bundle, graph="static", prefix_caching=False, max_running=8,
                                         speculative=mode, speculative_tokens=k)) for mode in ("off", "ngram")}
    for e in engines.values():
        e.warm_up()
    spec = engines["ngram"].speculation
    result = {"k": k, "calibration_ms": {"decode": {str(n): t * 1e3 for n, t in spec.decode_seconds.items()},
                                         "verify": (spec.verify_seconds * 1e3).tolist()}}
    for workload in WORKLOADS:
        ps = prompts_of(engines["off"].tokenizer, workload, prompts, random_ids)
        tps: dict[str, list[float]] = {m: [] for m in engines}
        texts: dict[str, list] = {}
        c = engines["ngram"].counters
        before = (c.draft_tokens, c.accepted_tokens, c.decode_calls, c.speculating_tokens)
        for r in range(rounds + 1):  # the first round warms up and is not counted
            spent = {m: [0, 0.0] for m in engines}  # tokens, seconds
            for mode in ("off", "ngram", "ngram", "off"):  # each round ABBA: the order costs both alike
                start, outs = time.perf_counter(), []
                for i, p in enumerate(ps):
                    [g] = engines[mode].generate([GenerationRequest(f"{workload}{r}{i}", p, SamplingParams(
                        temperature=0.0), StoppingCriteria(max_new_tokens=new_tokens))])
                    outs.append(g.token_ids())
                spent[mode][0] += sum(len(o) for o in outs)
                spent[mode][1] += time.perf_counter() - start
                texts[mode] = outs
            if r:
                for m, (tokens, seconds) in spent.items():
                    tps[m].append(tokens / seconds)
        proposed, accepted, calls, spec_tokens = (a - b for a, b in zip(
            (c.draft_tokens, c.accepted_tokens, c.decode_calls, c.speculating_tokens), before, strict=True))
        result[workload] = {"tokens_per_s": {m: statistics.median(v) for m, v in tps.items()},
                            "ratio_per_round": [a / b for a, b in zip(tps["ngram"], tps["off"], strict=True)],
                            "proposed": proposed, "accepted": accepted, "decode_calls": calls,
                            "tokens_from_verifications": spec_tokens,
                            "same_text": sum(a == b for a, b in zip(texts["off"], texts["ngram"], strict=True)),
                            "prompts": prompts}
    return result


def markdown(r: dict, command: str) -> str:
    lines = ["## Speculative decoding", "", f"`{command}` on {machine_line(r['machine'])}.", "",
             "Verify cost: a plain decode, and one row's verification of k + 1 tokens from position 8, ms "
             f"(medians of {r['rounds']} rounds; at 8 rows a speculating batch needs a verification per row):", "",
             "| model | decode, 1 row | decode, 8 rows | " + " | ".join(f"k={k}" for k in KS) + " |",
             "|---|---|---|" + "---|" * len(KS)]
    for name, c in r["verify_cost"].items():
        lines.append(f"| {name} | {c['decode_ms']['1']:.2f} | {c['decode_ms']['8']:.2f} | "
                     + " | ".join(f"{c['verify_ms'][str(k)]:.2f} ({c['verify_ms'][str(k)] / c['decode_ms']['1']:.1f}×)"
                                  for k in KS) + " |")
    w = r["workloads"]
    model = "The shipped model" if r.get("bundle") is None else f"`{r['bundle']}`"
    lines += ["", f"{model}, batch 1, greedy, {r['new_tokens']} new tokens, {r['prompts']} prompts per "
              f"workload, speculation off against prompt lookup (at most {w['k']} drafts), medians of "
              f"{r['rounds']} rounds, each off, ngram, ngram, off:", "",
              "| workload | off tokens/s | ngram tokens/s | ratio | drafts proposed | kept | same text |",
              "|---|---|---|---|---|---|---|"]
    for workload in WORKLOADS:
        x = w[workload]
        kept = x["accepted"] / x["proposed"] if x["proposed"] else 0.0
        lines.append(f"| {workload} | {x['tokens_per_s']['off']:.0f} | {x['tokens_per_s']['ngram']:.0f} | "
                     f"{statistics.median(x['ratio_per_round']):.2f}× | {x['proposed']} | {x['accepted']} "
                     f"({kept:.0%}) | {x['same_text']}/{x['prompts']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--prompts", type=int, default=5, help="prompts per workload")
    p.add_argument("--new-tokens", type=int, default=100)
    p.add_argument("--tokens", type=int, default=4, help="most drafts per step (--speculative-tokens)")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "speculative", help="the GPT-2-shape bundle")
    p.add_argument("--bundle", type=Path, help="the bundle measured (default: the shipped model)")
    p.add_argument("--no-gpt2", action="store_true", help="leave out GPT-2 124M's shape")
    p.add_argument("--random-prompts", action="store_true", help="random prompt ids instead of held-out text")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    from bench.sizes import prepare
    from service.engine.config import DEFAULT_BUNDLE

    bundle = args.bundle or DEFAULT_BUNDLE
    costs = {"shipped" if args.bundle is None else "measured": verify_cost(bundle, args.rounds)}
    if not args.no_gpt2:
        costs["gpt2-124m shape"] = verify_cost(prepare("gpt2-124m", args.work, int4=False).bundle, args.rounds)
    result = {"machine": describe(), "rounds": args.rounds, "prompts": args.prompts, "new_tokens": args.new_tokens,
              "bundle": shown(str(args.bundle)) if args.bundle else None, "verify_cost": costs,
              "workloads": workload_runs(bundle, args.new_tokens, args.prompts, args.rounds, args.tokens,
                                         args.random_prompts)}
    command = shown(" ".join(["attnserve bench speculative", *argv]))
    result["command"] = command
    text = markdown(result, command)
    print(text)
    publish("speculative", result, text, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
