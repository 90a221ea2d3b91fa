"""Score the served G2P model on its held-out test words, and write the scores into its card.

    attnserve score-g2p --model models/g2p-cmudict --bundle models/g2p-cmudict-onnx \
        --runs runs/g2p-*/training_log.json

Every test word goes through the serving engine (`service.engine`), as a client's request would (so this
lives beside the benchmarks: model/ uses only the runtime of service/): each
graph of the bundle (fp32, and INT8 when the bundle has it), greedy and with beam search of each
`--beams` width, 32 words at a time. The scores (WER, PER) and a summary of each training run named
by `--runs` are written to `<model>/scores.json`, and the model card (`README.md`) is written again
with them: greedy and beam figures side by side, and every run that chose the model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from attnserve.arguments import HintingParser
from model.training import g2p_data as data
from model.training.g2p_card import write_g2p_card
from model.training.train_g2p import G2PTrainConfig, training_command

SCORES_FILE = "scores.json"
CONCURRENCY = 32


def served_phonemes(bundle: Path, graph: str, words: list[str], beam: int) -> dict[str, data.Pronunciation]:
    """Each word's phonemes from the engine serving `graph` of `bundle`: greedy (beam 1) or its best beam."""
    from service.engine.config import EngineConfig
    from service.engine.core import Engine
    from service.engine.request import BeamParams, GenerationRequest, SamplingParams, StoppingCriteria

    engine = Engine(EngineConfig(bundle=bundle, graph=graph, max_running=CONCURRENCY * beam,
                                 max_batch_tokens=CONCURRENCY * beam * 40, max_waiting=len(words)))
    max_new = engine.context - 1
    requests = [GenerationRequest(f"w{i}", engine.tokenizer.encode(w), SamplingParams(temperature=0.0),
                                  StoppingCriteria(max_new_tokens=max_new), beam=BeamParams(beam) if beam > 1 else None)
                for i, w in enumerate(words)]
    out = {}
    for word, done in zip(words, engine.generate(requests), strict=True):
        if done.error is not None:
            raise RuntimeError(f"{word!r} failed: {done.error}")
        tokens = [engine.tokenizer.hf.id_to_token(i) for i in done.token_ids()]
        out[word] = tuple(t for t in tokens if t in data.PHONEMES)
    return out


def score_bundle(bundle: Path, beams: list[int]) -> list[dict]:
    from service.runtime.bundle import read_manifest

    test = data.split_words(data.load_cmudict()).test
    words = sorted(test)
    rows = []
    for graph, spec in read_manifest(bundle).graphs.items():
        for beam in beams:
            started = time.perf_counter()
            scores = data.score(served_phonemes(bundle, graph, words, beam), test)
            rows.append({"graph": graph, "weights": spec.weights, "beam": beam, "words": scores.words,
                         "wer": scores.wer, "per": scores.per, "seconds": round(time.perf_counter() - started, 1)})
            print(f"  {graph} ({spec.weights}), {'greedy' if beam == 1 else f'beam {beam}'}: WER {scores.wer:.2%}, "
                  f"PER {scores.per:.2%} on {scores.words:,} words")
    return rows


def run_summary(log_path: Path) -> dict:
    """What a training run was and what it reached, from its training_log.json."""
    log = json.loads(log_path.read_text())
    t, c, r = log["train_config"], log["model_config"], log["result"]
    best = min(log["history"], key=lambda h: h["dev_wer"])
    return {"run": log_path.parent.name, "layers": f"{c['n_encoder_layer']}+{c['n_decoder_layer']}",
            "d_model": c["d_model"], "d_ff": c["d_ff"], "dropout": t["dropout"],
            "label_smoothing": t["label_smoothing"], "lr": t["lr"], "warmup_steps": t["warmup_steps"],
            "schedule_steps": t["max_steps"], "steps": r["steps"], "minutes": round(r["wall_time_s"] / 60, 1),
            "best_dev_wer": best["dev_wer"], "best_dev_step": best["step"], "test_wer": r["test_wer"],
            "test_per": r["test_per"], "curve": [(h["step"], h["dev_wer"]) for h in log["history"]]}


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve score-g2p", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/g2p-cmudict"), help="the trained model directory")
    p.add_argument("--bundle", type=Path, default=Path("models/g2p-cmudict-onnx"), help="its exported bundle")
    p.add_argument("--beams", type=int, nargs="+", default=[1, 2, 4, 8], help="beam widths (1: greedy)")
    p.add_argument("--runs", type=Path, nargs="*", default=[],
                   help="training_log.json of each run to list in the card (the model's own is always listed)")
    args = p.parse_args(argv)
    served = score_bundle(args.bundle, sorted(set(args.beams)))
    own = args.model / "training_log.json"
    logs = [own] + [r for r in args.runs if r.resolve() != own.resolve()]
    runs = [run_summary(path) for path in logs]
    runs[0]["run"] = f"{args.model.name} (this model)"
    (args.model / SCORES_FILE).write_text(json.dumps({"served": served, "runs": runs}, indent=2) + "\n")
    log = json.loads(own.read_text())
    write_g2p_card(args.model, log, training_command(G2PTrainConfig(**{**log["train_config"], "out": str(args.model)})))
    print(f"wrote {args.model / SCORES_FILE} and {args.model / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
