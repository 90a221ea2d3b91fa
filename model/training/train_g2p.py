"""Train the grapheme-to-phoneme model: an encoder-decoder Transformer on the CMU Pronouncing Dictionary.

    attnserve train-g2p --out models/g2p-cmudict       # or: python -m model.training.train_g2p --out ...

Sources are a word's letters, targets its ARPAbet phonemes (`g2p_data`). Every pronunciation of a
training word is an example. AdamW (β2 = 0.98, as in the paper) with linear warmup and cosine decay,
label smoothing, gradient clipping; batches are drawn at random, 16 at a time, and cut by length so
that they pad little. The dev words are
decoded greedily every `eval_interval` steps and the checkpoint with the lowest dev WER is kept; at
the end the test words are decoded once and scored (WER, PER). The run is seeded. It writes the model
directory (config.json with `"kind": "encoder-decoder"`, model.safetensors, tokenizer.json),
`training_log.json` and the model card `README.md`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from model.checkpoint import load_seq2seq_dir, save_model_dir
from model.seq2seq import EncoderDecoder
from model.seq2seq_config import Seq2SeqConfig
from model.training import g2p_data as data
from model.training.config_cli import command_line, parser_for
from model.training.g2p_card import write_g2p_card
from model.training.g2p_data import EOS, PAD, START, Pronunciation
from model.training.g2p_decode import evaluate, pad
from model.training.train import cpu_has_bf16, optimizer_step
from service.runtime.cpu import cpu_info
from service.runtime.tokenizer import Tokenizer

SRC_CTX = 34  # longest source: MAX_LETTERS + room
TGT_CTX = 36  # longest target: the start token, the phonemes (at most 34 in the dictionary) and EOS


@dataclass
class G2PTrainConfig:
    out: str = "models/g2p-cmudict"
    n_encoder_layer: int = 4
    n_decoder_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ff: int = 1024
    norm_placement: str = "post"  # "post" (the paper) or "pre"
    pos_encoding: str = "sinusoidal"  # or "learned"
    embedding_norm: bool = True  # a LayerNorm after the embeddings, as BART has (so BART can express the model)
    dropout: float = 0.1
    label_smoothing: float = 0.1
    batch_size: int = 256  # words per step
    max_steps: int = 9000  # about 2 hours on 2 cores with bf16 (0.5-0.9 s a step, evaluation included)
    lr: float = 1e-3
    min_lr: float = 2e-5
    warmup_steps: int = 400
    weight_decay: float = 0.01
    optimizer: str = "adamw"  # "adamw" everywhere, or "muon" for the layers' weight matrices (AdamW for the rest)
    bf16: bool = True  # bf16 autocast for the matmuls (fp32 master weights); ignored without CPU support
    grad_clip: float = 1.0
    eval_interval: int = 500
    seed: int = 1234
    minutes: float = 130.0  # stop after this much training (0 = no limit); the schedule still ends at max_steps


# ---- data ------------------------------------------------------------------------------------------


def phoneme_ids(tokenizer: Tokenizer, pron: Pronunciation) -> list[int]:
    return [tokenizer.hf.token_to_id(p) for p in pron]


@dataclass
class Examples:
    """Every (source, target) pair: target = phonemes + EOS."""

    src: list[list[int]]
    tgt: list[list[int]]

    @classmethod
    def of(cls, tokenizer: Tokenizer, words: dict[str, list[Pronunciation]]) -> Examples:
        src, tgt = [], []
        eos = tokenizer.hf.token_to_id(EOS)
        for word, prons in words.items():
            ids = tokenizer.encode(word)
            for pron in prons:
                src.append(ids)
                tgt.append(phoneme_ids(tokenizer, pron) + [eos])
        return cls(src, tgt)

    def bucketed(self, batch_size: int, gen: torch.Generator, group: int = 16) -> list[list[int]]:
        """`group` batches drawn at random together and cut by source length, so that a batch pads little."""
        pool = torch.randint(len(self.src), (batch_size * group,), generator=gen).tolist()
        pool.sort(key=lambda i: (len(self.src[i]), len(self.tgt[i])))
        batches = [pool[at:at + batch_size] for at in range(0, len(pool), batch_size)]
        order = torch.randperm(len(batches), generator=gen).tolist()
        return [batches[i] for i in order]

    def batch(self, index: list[int], start: int, pad_id: int) -> tuple[torch.Tensor, ...]:
        src = pad([self.src[i] for i in index], pad_id)
        tgt_out = pad([self.tgt[i] for i in index], -100)
        before = tgt_out[:, :-1]
        tgt_in = torch.cat([torch.full((len(index), 1), start), before.masked_fill(before < 0, pad_id)], dim=1)
        return src, (src != pad_id).long(), tgt_in, tgt_out


# ---- training ----------------------------------------------------------------------------------------


def model_config(cfg: G2PTrainConfig, tokenizer: Tokenizer) -> Seq2SeqConfig:
    vocab = tokenizer.hf.get_vocab()
    return Seq2SeqConfig(
        vocab_size=tokenizer.vocab_size, n_src_ctx=SRC_CTX, n_tgt_ctx=TGT_CTX,
        n_encoder_layer=cfg.n_encoder_layer, n_decoder_layer=cfg.n_decoder_layer, n_head=cfg.n_head,
        d_model=cfg.d_model, d_ff=cfg.d_ff, dropout=cfg.dropout, norm_placement=cfg.norm_placement,
        pos_encoding=cfg.pos_encoding, embedding_norm=cfg.embedding_norm, activation="relu", share_embeddings=True,
        tie_embeddings=True,
        scale_embedding=True, pad_token_id=vocab[PAD], eos_token_id=vocab[EOS], decoder_start_token_id=vocab[START])


def make_optimizers(model: EncoderDecoder, cfg: G2PTrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW (β2 = 0.98, as in the paper), or Muon for the 2-D weights inside the encoder and decoder layers
    with AdamW for the rest (embeddings, norms, biases). Weight decay touches matrices only."""
    if cfg.optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be 'adamw' or 'muon', got {cfg.optimizer!r}")
    named = list(model.named_parameters())
    in_layers = ("encoder.", "decoder.")
    hidden = [p for n, p in named if cfg.optimizer == "muon" and n.startswith(in_layers) and p.dim() == 2]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in hidden_ids]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9)]
    if hidden:
        optimizers.append(torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           adjust_lr_fn="match_rms_adamw"))
    return optimizers


def write_generation_config(out: Path, c: Seq2SeqConfig) -> None:
    """generation_config.json: greedy by default (a word has one spelling in phonemes, or a few; sampling
    from the rest of the distribution only adds errors), the ids that start and end a target."""
    config = {"do_sample": False, "decoder_start_token_id": c.decoder_start_token_id, "eos_token_id": c.eos_token_id,
              "pad_token_id": c.pad_token_id, "max_length": c.n_tgt_ctx}
    (out / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


def lr_at(step: int, cfg: G2PTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def train(cfg: G2PTrainConfig) -> dict:
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    tokenizer = data.g2p_tokenizer()
    split = data.split_words(data.load_cmudict())
    examples = Examples.of(tokenizer, split.train)
    model = EncoderDecoder(model_config(cfg, tokenizer))
    c = model.config
    optimizers = make_optimizers(model, cfg)
    bf16 = cfg.bf16 and cpu_has_bf16()
    gen = torch.Generator().manual_seed(cfg.seed)
    print(f"g2p: {model.num_parameters() / 1e6:.2f}M parameters; train {len(split.train):,} words "
          f"({len(examples.src):,} pronunciations), dev {len(split.dev):,}, test {len(split.test):,}; bf16={bf16}")
    history: list[dict] = []
    batches: list[list[int]] = []
    best = math.inf
    t0 = time.perf_counter()
    step = 0
    while step < cfg.max_steps:
        if cfg.minutes and time.perf_counter() - t0 > cfg.minutes * 60:
            print(f"stopped at step {step} of {cfg.max_steps}: the {cfg.minutes}-minute budget is spent")
            break
        model.train()
        lr = lr_at(step, cfg)
        for group in (g for o in optimizers for g in o.param_groups):
            group["lr"] = lr
        if not batches:
            batches = examples.bucketed(cfg.batch_size, gen)
        src, src_mask, tgt_in, tgt_out = examples.batch(batches.pop(), c.decoder_start_token_id, c.pad_token_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model.loss(src, tgt_in, tgt_out, src_mask, label_smoothing=cfg.label_smoothing)
        optimizer_step(loss, model, optimizers, cfg.grad_clip)
        step += 1
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            dev = evaluate(model, tokenizer, split.dev)
            elapsed = time.perf_counter() - t0
            history.append({"step": step, "train_loss": round(loss.item(), 4), "dev_wer": dev.wer,
                            "dev_per": dev.per, "lr": lr, "elapsed_s": round(elapsed, 1)})
            improved = dev.wer < best
            if improved:
                best = dev.wer
                save_model_dir(model, tokenizer, out, metadata={"source": "attnserve train-g2p"})
                write_generation_config(out, c)
            print(f"step {step}: loss {loss.item():.4f}  dev WER {dev.wer:.2%} PER {dev.per:.2%}"
                  f"{'  (best, saved)' if improved else ''}  [{elapsed / 60:.1f} min]", flush=True)
    wall = time.perf_counter() - t0
    if not history:
        raise RuntimeError("training stopped before the first evaluation; raise --minutes or lower --eval-interval")
    return finish(cfg, out, split, history, wall, step)


def finish(cfg: G2PTrainConfig, out: Path, split, history: list[dict], wall_s: float, steps: int) -> dict:
    """Score the kept checkpoint on the test words; write the log and the model card."""
    model, tokenizer = load_seq2seq_dir(out)
    test = evaluate(model, tokenizer, split.test)
    result = {"test_words": test.words, "test_wer": test.wer, "test_per": test.per,
              "parameters": model.num_parameters(), "steps": steps, "wall_time_s": round(wall_s, 1),
              "torch_threads": torch.get_num_threads(), "cpu": cpu_info().describe()}
    log = {"train_config": asdict(cfg), "model_config": model.config.to_dict(), "result": result,
           "history": history, "split": {"train": len(split.train), "dev": len(split.dev), "test": len(split.test)}}
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    write_g2p_card(out, log, training_command(cfg))
    print(f"test ({test.words:,} words): WER {test.wer:.2%}, PER {test.per:.2%}; wall {wall_s / 60:.1f} min")
    return result


def training_command(cfg: G2PTrainConfig) -> str:
    return command_line(cfg, "attnserve train-g2p")


def build_parser() -> argparse.ArgumentParser:
    return parser_for(G2PTrainConfig, "attnserve train-g2p", __doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    train(G2PTrainConfig(**vars(build_parser().parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
