"""Sample from a model directory in PyTorch, for a quick look at a checkpoint.

    attnserve generate-local "Rom." --model models/shakespeare     # or: python -m model.generate ...

Prompts of different lengths are left-padded into one batch and decoded from a `BatchKVCache`.
Serving does not use this module; it runs the exported ONNX graph.
"""

from __future__ import annotations

import argparse

import torch

from attnserve.arguments import HintingParser
from model.gpt import GPT

DEFAULT_MODEL_DIR = "models/shakespeare"


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids (B, L) and attention_mask (B, L), padding on the left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def generate(
    model: GPT,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
) -> list[list[int]]:
    """Continue each prompt by up to max_new_tokens ids (greedy when temperature == 0).

    A row stops after it emits eos_id (which is included); the others go on.
    """
    model.eval()
    ids, mask = left_pad(prompts, pad_id=model.config.eos_token_id)
    B, L = ids.shape
    if L + max_new_tokens > model.config.n_ctx:
        raise ValueError(f"prompt ({L}) + max_new_tokens ({max_new_tokens}) exceeds n_ctx={model.config.n_ctx}")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = model.new_kv_cache(B, max_len=L + max_new_tokens)
    logits = model(ids, attention_mask=mask, kv_cache=cache)[:, -1]  # (B, vocab)
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    for step in range(max_new_tokens):
        nxt = pick_next(logits, temperature, top_k, gen)  # (B,)
        for i in range(B):
            if not done[i]:
                out[i].append(int(nxt[i]))
        if eos_id is not None:
            done |= nxt == eos_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], dim=1)
        logits = model(nxt[:, None], attention_mask=mask, kv_cache=cache)[:, -1]
    return out


def pick_next(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator | None) -> torch.Tensor:
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


def build_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="attnserve generate-local", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", help="text to continue")
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="model directory")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    from model.checkpoint import load_model_dir

    args = build_parser().parse_args(argv)
    model, tokenizer = load_model_dir(args.model)
    prompt_ids = tokenizer.encode(args.prompt)
    room = model.config.n_ctx - len(prompt_ids)
    if room <= 0:
        raise SystemExit(f"prompt is {len(prompt_ids)} tokens; the model context is {model.config.n_ctx}")
    new = generate(model, [prompt_ids], min(args.max_new_tokens, room), temperature=args.temperature,
                   top_k=args.top_k, eos_id=tokenizer.eos_id, seed=args.seed)[0]
    print(args.prompt + tokenizer.decode(new, skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
