"""Train the default model: byte-level BPE + GPT on the Shakespeare corpus, on CPU.

    attnserve train --out models/shakespeare          # or: python -m model.training.train --out ...

AdamW with linear warmup and cosine decay, gradient clipping, bf16 autocast where the CPU has
native bf16 matmuls. Validation (on the held-out plays of `data.VAL_PLAYS`) runs every
`eval_interval` steps; the best checkpoint is the one kept in `--out`. `--resume` continues from
`<out>/resume/`. The run is seeded: the same command gives the same model.

At the end it writes `training_log.json`, `loss_curve.png` and the model card `README.md`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from model.checkpoint import TOKENIZER_FILE, load_weights, save_model_dir, weights_for_saving
from model.config import GPTConfig
from model.gpt import GPT
from model.training.config_cli import command_line, parser_for
from model.training.data import VAL_PLAYS, Corpus, load_corpus
from model.training.scoring import bits_per_char, encode_documents, eval_batches
from model.training.tokenizer import train_bpe
from service.runtime.cpu import cpu_info
from service.runtime.tokenizer import Tokenizer


@dataclass
class TrainConfig:
    out: str = "models/shakespeare"  # model directory written (best checkpoint, log, card)
    vocab_size: int = 4096  # BPE vocabulary, special tokens included
    arch: str = "gpt"  # "gpt": learned positions, LayerNorm, GELU; "llama": rotary, RMSNorm, SwiGLU, GQA
    n_layer: int = 6  # Transformer blocks
    n_head: int = 4  # attention heads
    n_kv_head: int = 0  # key/value heads with --arch llama; 0 = half the heads (grouped-query attention)
    d_model: int = 256  # residual width
    n_ctx: int = 256  # context length trained on (and the model's maximum)
    dropout: float = 0.0  # embedding and residual dropout (0.1 cost 25% of throughput; see docs/model.md)
    attn_dropout: float = 0.0  # attention-weight dropout; off, as it costs throughput (docs/model.md)
    batch_size: int = 16  # sequences per optimiser step
    max_steps: int = 1500  # optimiser steps; the cosine schedule ends here
    lr: float = 2e-3  # peak learning rate (Muon scales it to match AdamW's update size)
    min_lr: float = 1e-4  # learning rate at the end of the cosine decay
    warmup_steps: int = 100  # linear warmup from 0 to lr
    weight_decay: float = 0.1  # decoupled weight decay, on matrices only
    optimizer: str = "muon"  # "muon" for the blocks' matrices (AdamW for the rest), or "adamw" everywhere
    grad_clip: float = 1.0  # max global gradient norm
    eval_interval: int = 100  # steps between validation runs
    eval_windows: int = 64  # validation windows used by the periodic eval (the final one uses all)
    seed: int = 1337  # seeds the init, the batch sampler and dropout
    bf16: bool = True  # bf16 autocast for matmuls (fp32 master weights); ignored without CPU support
    compile: bool = True  # torch.compile the training step (needs a C++ compiler; compiling delays the first step)
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    stop_at: int = 0  # stop early after this step (0 = max_steps); --resume carries on from there


def architecture(cfg: TrainConfig) -> dict:
    """The GPTConfig fields that make --arch llama: rotary positions, RMSNorm, a SwiGLU feed-forward as
    wide as keeps the GELU MLP's parameter count (8/3 d, rounded up to 64), grouped-query attention, no
    biases. --arch gpt leaves the defaults (GPT-2's layout)."""
    if cfg.arch == "gpt":
        return {}
    if cfg.arch != "llama":
        raise ValueError(f"arch must be 'gpt' or 'llama', got {cfg.arch!r}")
    d_ff = -(-8 * cfg.d_model // 3 // 64) * 64
    return dict(pos_encoding="rotary", norm="rmsnorm", mlp="swiglu", bias=False, d_ff=d_ff,
                n_kv_head=cfg.n_kv_head or max(1, cfg.n_head // 2))


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def sample_batch(data: np.ndarray, batch_size: int, n_ctx: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    starts = torch.randint(0, len(data) - n_ctx - 1, (batch_size,), generator=gen).numpy()
    rows = np.stack([data[s: s + n_ctx + 1] for s in starts])  # (B, n_ctx + 1)
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


@torch.no_grad()
def evaluate(model: GPT, data: np.ndarray, n_ctx: int, max_windows: int | None, bf16: bool) -> float:
    """Mean next-token NLL (nats/token) over non-overlapping windows of the validation stream."""
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for x, y in eval_batches(data, n_ctx, max_windows):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(torch.from_numpy(x))
        total_nll += F.cross_entropy(logits.float().flatten(0, 1), torch.from_numpy(y).flatten(),
                                     reduction="sum").item()
        total_tokens += y.size
    model.train()
    return total_nll / total_tokens


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def make_optimizers(model: GPT, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW everywhere, or Muon for the 2-D weights inside the blocks and AdamW for the rest.

    Embeddings (and the tied head) and all vectors stay on AdamW; weight decay only touches matrices.
    """
    if cfg.optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be 'adamw' or 'muon', got {cfg.optimizer!r}")
    named = list(model.named_parameters())
    hidden = [p for n, p in named if cfg.optimizer == "muon" and n.startswith("blocks.") and p.dim() == 2]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in hidden_ids]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)]
    if hidden:
        optimizers.append(torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           adjust_lr_fn="match_rms_adamw"))
    return optimizers


def optimizer_step(loss: Tensor, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                   grad_clip: float) -> None:
    """Backpropagate `loss`, clip the global gradient norm to `grad_clip`, step every optimizer, clear."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    for o in optimizers:
        o.step()
        o.zero_grad(set_to_none=True)


def save_resume_state(resume_dir: Path, model, optimizers, step, history, best_val, gen) -> None:
    resume_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights_for_saving(model), str(resume_dir / "model.safetensors"))
    torch.save([o.state_dict() for o in optimizers], resume_dir / "optimizer.pt")
    torch.save({"sampler": gen.get_state(), "torch": torch.get_rng_state()}, resume_dir / "rng.pt")
    state = {"step": step, "best_val": best_val, "history": history}
    (resume_dir / "state.json").write_text(json.dumps(state))


def load_resume_state(resume_dir: Path, model, optimizers, gen) -> tuple[int, list, float]:
    load_weights(model, resume_dir / "model.safetensors")
    for o, state in zip(optimizers, torch.load(resume_dir / "optimizer.pt", weights_only=True), strict=True):
        o.load_state_dict(state)
    rng = torch.load(resume_dir / "rng.pt", weights_only=True)
    gen.set_state(rng["sampler"])
    torch.set_rng_state(rng["torch"])
    state = json.loads((resume_dir / "state.json").read_text())
    return state["step"], state["history"], state["best_val"]


def train(cfg: TrainConfig, resume: bool = False, corpus: Corpus | None = None) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resume_dir = out / "resume"
    bf16 = cfg.bf16 and cpu_has_bf16()
    torch.manual_seed(cfg.seed)

    corpus = corpus or load_corpus()
    if resume and (out / TOKENIZER_FILE).exists():
        tokenizer = Tokenizer.from_file(out / TOKENIZER_FILE)
    else:
        tokenizer = Tokenizer(train_bpe(corpus.train, cfg.vocab_size))
    train_ids = encode_documents(tokenizer, corpus.train)
    val_ids = encode_documents(tokenizer, corpus.val)

    config = GPTConfig(vocab_size=tokenizer.vocab_size, n_ctx=cfg.n_ctx, n_layer=cfg.n_layer, n_head=cfg.n_head,
                       d_model=cfg.d_model, dropout=cfg.dropout, attn_dropout=cfg.attn_dropout,
                       eos_token_id=tokenizer.eos_id, **architecture(cfg))
    model = GPT(config)
    optimizers = make_optimizers(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, history, best_val = 0, [], float("inf")
    if resume and (resume_dir / "state.json").exists():
        step, history, best_val = load_resume_state(resume_dir, model, optimizers, gen)
        print(f"resumed from {resume_dir} at step {step}")
    print(f"model: {model.num_parameters() / 1e6:.2f}M parameters; train {len(train_ids):,} tokens, "
          f"val {len(val_ids):,} tokens / {corpus.val_chars:,} chars; bf16={bf16}")

    tokens_per_step = cfg.batch_size * cfg.n_ctx
    loss_fn = torch.compile(model.loss) if cfg.compile else model.loss
    model.train()
    t0 = time.perf_counter()
    elapsed_before = history[-1]["elapsed_s"] if history else 0.0
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True, mininterval=2.0)
    last_step = min(cfg.stop_at or cfg.max_steps, cfg.max_steps)
    while step < last_step:
        t_step = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in (g for o in optimizers for g in o.param_groups):
            group["lr"] = lr
        x, y = sample_batch(train_ids, cfg.batch_size, cfg.n_ctx, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(x, y)
        optimizer_step(loss, model, optimizers, cfg.grad_clip)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_per_step / (time.perf_counter() - t_step):.0f}",
                        lr=f"{lr:.2e}")

        if step % cfg.eval_interval == 0 or step == last_step:
            val = evaluate(model, val_ids, cfg.n_ctx, cfg.eval_windows, bf16)
            elapsed = elapsed_before + time.perf_counter() - t0
            history.append({"step": step, "train_loss": loss.item(), "val_loss": val, "lr": lr,
                            "tokens": step * tokens_per_step, "elapsed_s": round(elapsed, 1)})
            improved = val < best_val
            if improved:
                best_val = val
                save_model_dir(model, tokenizer, out)
            bar.write(f"step {step}: train {loss.item():.4f}  val {val:.4f} nats/token"
                      f"{'  (best, saved)' if improved else ''}  [{elapsed / 60:.1f} min]")
            save_resume_state(resume_dir, model, optimizers, step, history, best_val, gen)
    bar.close()
    wall_s = elapsed_before + time.perf_counter() - t0
    if step < cfg.max_steps:
        print(f"stopped at step {step} of {cfg.max_steps}; continue with --resume")
        return {"stopped_at": step}
    return finish(cfg, out, tokenizer, corpus, val_ids, history, wall_s, bf16)


def finish(cfg, out, tokenizer, corpus, val_ids, history, wall_s, bf16) -> dict:
    """Score the best checkpoint on the whole validation set; write the log, plot and model card."""
    from model.checkpoint import load_model_dir
    from model.training.model_card import plot_loss_curve, write_model_card

    model, _ = load_model_dir(out)
    val_nats = evaluate(model, val_ids, cfg.n_ctx, None, bf16=False)  # fp32, every window
    n_predicted = len(val_ids) - 1
    result = {
        "val_nats_per_token": val_nats,
        "val_bits_per_char": bits_per_char(val_nats, n_predicted, corpus.val_chars),
        "val_tokens": n_predicted,
        "val_chars": corpus.val_chars,
        "val_plays": list(VAL_PLAYS),
        "parameters": model.num_parameters(),
        "wall_time_s": round(wall_s, 1),
        "bf16": bf16,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_info().describe(),
    }
    log = {"train_config": asdict(cfg), "model_config": model.config.to_dict(), "result": result, "history": history}
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    plot_loss_curve(history, out / "loss_curve.png")
    write_model_card(out, log, model, tokenizer, training_command(cfg))
    print(f"val: {val_nats:.4f} nats/token, {result['val_bits_per_char']:.4f} bits/char; wall {wall_s / 60:.1f} min")
    return result


def training_command(cfg: TrainConfig) -> str:
    """The shortest `attnserve train` line that reproduces cfg: every non-default field as a flag."""
    return command_line(cfg, "attnserve train")


def build_parser() -> argparse.ArgumentParser:
    p = parser_for(TrainConfig, "attnserve train", __doc__.split("\n\n")[0])
    p.add_argument("--resume", action="store_true", help="continue from <out>/resume/")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    resume = args.pop("resume")
    train(TrainConfig(**args), resume=resume)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
