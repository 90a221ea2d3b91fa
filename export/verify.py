"""Check an exported bundle against PyTorch on fresh inputs, shaped unlike the ones used for tracing.

Three checks, each through the serving runner (`service.runtime.concat_runner.ConcatRunner`):
- prefill: batch 5 x 33 tokens, left-padded rows of mixed lengths;
- decode: batch 2 with a left-padded past of 100 positions, one new token;
- greedy: a 64-token greedy continuation, token for token.
Plus `onnx.checker` on the graph. Logits must agree to `tol` (max |Δ|) and greedy tokens exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch

from model.generate import generate
from model.gpt import GPT
from service.runtime.concat_runner import ConcatRunner


@dataclass
class Check:
    name: str  # which comparison
    max_abs_diff: float  # max |logits_onnx - logits_torch|
    passed: bool
    detail: str = ""  # extra facts (shapes, token counts)


@dataclass
class Report:
    graph: str  # bundle graph variant checked
    tol: float  # allowed max |Δlogits|
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def format(self) -> str:
        tolerance = f" (tolerance {self.tol:g})" if math.isfinite(self.tol) else ""  # nan: no logit tolerance
        lines = [f"verify {self.graph}{tolerance}:"]
        for c in self.checks:
            lines.append(f"  {'ok  ' if c.passed else 'FAIL'} {c.name:<10} max|Δlogits| = {c.max_abs_diff:.2e}"
                         f"{'  ' + c.detail if c.detail else ''}")
        lines.append("  PASSED" if self.passed else "  FAILED")
        return "\n".join(lines)


def left_padded(rng: np.random.Generator, lengths: list[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(lengths)
    ids = np.zeros((len(lengths), width), dtype=np.int64)
    mask = np.zeros((len(lengths), width), dtype=np.int64)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rng.integers(0, vocab, n)
        mask[i, width - n:] = 1
    return ids, mask


def positions(mask: np.ndarray) -> np.ndarray:
    return np.clip(mask.cumsum(-1) - 1, 0, None)


def max_diff(a: np.ndarray, b: torch.Tensor) -> float:
    return float(np.abs(a.astype(np.float64) - b.double().numpy()).max())


@torch.no_grad()
def check_prefill(model: GPT, runner: ConcatRunner, rng: np.random.Generator, tol: float) -> Check:
    lengths = [33, 1, 20, 33, 7]
    ids, mask = left_padded(rng, lengths, model.config.vocab_size)
    pos = positions(mask)
    want = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(pos))
    got, _ = runner.step(ids, pos, mask, runner.empty_cache(len(lengths)))
    d = max_diff(got, want)
    return Check("prefill", d, d <= tol and bool(np.isfinite(got).all()), f"batch 5 x 33, lengths {lengths}")


@torch.no_grad()
def check_decode(model: GPT, runner: ConcatRunner, rng: np.random.Generator, tol: float) -> Check:
    lengths = [100, 61]
    ids, mask = left_padded(rng, lengths, model.config.vocab_size)
    pos = positions(mask)
    cache = model.new_kv_cache(2, max_len=max(lengths) + 1)  # not the whole context: 1.6 GB at 0.5B, 32k positions
    model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(pos),
          kv_cache=cache)
    _, past = runner.step(ids, pos, mask, runner.empty_cache(2))

    new_ids = rng.integers(0, model.config.vocab_size, (2, 1))
    mask = np.concatenate([mask, np.ones((2, 1), dtype=np.int64)], axis=1)
    new_pos = pos[:, -1:] + 1
    want = model(torch.from_numpy(new_ids), attention_mask=torch.from_numpy(mask),
                 position_ids=torch.from_numpy(new_pos), kv_cache=cache)
    got, present = runner.step(new_ids, new_pos, mask, past)
    d = max_diff(got, want)
    d_cache = max(max_diff(present[2 * i], cache.k[i, :, :, :101]) for i in range(model.config.n_layer))
    ok = d <= tol and d_cache <= tol and present[0].shape[2] == 101
    return Check("decode", d, ok, f"batch 2, past 100 (lengths {lengths}), max|Δcache| = {d_cache:.2e}")


@torch.no_grad()
def check_greedy(model: GPT, runner: ConcatRunner, rng: np.random.Generator, tol: float, n_new: int = 64) -> Check:
    prompt = rng.integers(0, model.config.vocab_size, 8).tolist()
    want_tokens = generate(model, [prompt], n_new, temperature=0.0)[0]

    ids = np.array([prompt], dtype=np.int64)
    mask = np.ones_like(ids)
    logits, cache = runner.step(ids, positions(mask), mask, runner.empty_cache(1))
    got_tokens, worst = [], 0.0
    seq = list(prompt)
    for _ in range(n_new):
        nxt = int(np.argmax(logits[0, -1]))
        want_logits = model(torch.tensor([seq]))[0, -1]
        worst = max(worst, max_diff(logits[0, -1], want_logits))
        got_tokens.append(nxt)
        seq.append(nxt)
        mask = np.ones((1, len(seq)), dtype=np.int64)
        logits, cache = runner.step(np.array([[nxt]]), np.array([[len(seq) - 1]]), mask, cache)
    same = got_tokens == want_tokens
    return Check("greedy", worst, same and worst <= tol,
                 f"{n_new} tokens, {'identical' if same else 'DIFFERENT'} to PyTorch")


def verify(model: GPT, runner: ConcatRunner, tol: float = 1e-4, seed: int = 0) -> Report:
    if model.config.n_ctx < 101 + 1:
        raise ValueError(f"verification needs a context of at least 102 positions, the model has {model.config.n_ctx}")
    rng = np.random.default_rng(seed)
    report = Report(runner.graph_name, tol)
    path = runner.bundle_dir / runner.spec.file
    try:
        onnx.checker.check_model(str(path), full_check=True)
        report.checks.append(Check("checker", 0.0, True, "onnx.checker.check_model(full_check=True)"))
    except onnx.checker.ValidationError as e:
        report.checks.append(Check("checker", 0.0, False, str(e).splitlines()[0]))
    report.checks += [check_prefill(model, runner, rng, tol), check_decode(model, runner, rng, tol),
                      check_greedy(model, runner, rng, tol)]
    return report


@torch.no_grad()
def verify_static(model: GPT, bundle_dir, graph: str = "static", tol: float = 1e-4, seed: int = 0) -> Report:
    """The static-cache graph through the engine's runner: batched prefill of mixed lengths into
    slots, a chunked prefill, decode steps, a slot move, and a 64-token greedy run, all vs PyTorch."""
    from service.runtime.static_runner import StaticRunner

    rng = np.random.default_rng(seed)
    runner = StaticRunner(bundle_dir, graph, provider="cpu")
    buffers = runner.cache_shape.buffers(4)
    runner.attach(buffers)
    report = Report(graph, tol)
    vocab = model.config.vocab_size

    def want(seq: list[int]) -> torch.Tensor:
        return model(torch.tensor([seq]))[0, -1]

    seqs = [rng.integers(0, vocab, n).tolist() for n in (33, 1, 20)]
    got = runner.prefill_batch(0, seqs)
    d = max(max_diff(got[i], want(s)) for i, s in enumerate(seqs))
    report.checks.append(Check("prefill", d, d <= tol, "batch 3, lengths [33, 1, 20], one slot each"))

    long = rng.integers(0, vocab, 100).tolist()
    for start in range(0, 100, 40):
        got = runner.prefill(3, long[start:start + 40], start)
    d = max_diff(got, want(long))
    report.checks.append(Check("chunked", d, d <= tol, "100 tokens in chunks of 40"))

    def decode_all(seqs: list[list[int]]) -> float:
        """One decode step of a random token in every row; the largest difference from the reference."""
        new = rng.integers(0, vocab, len(seqs))
        pos = np.array([len(s) for s in seqs])
        for s, t in zip(seqs, new, strict=True):
            s.append(int(t))
        got = runner.decode(new, pos)
        return max(max_diff(got[i], want(s)) for i, s in enumerate(seqs))

    seqs.append(long)
    worst = max(decode_all(seqs) for _ in range(4))
    for b in buffers:  # slot 3 moves into slot 0 (its live prefix only), as the engine moves a slot into a hole
        b[0, :, :len(seqs[3])] = b[3, :, :len(seqs[3])]
    worst = max(worst, decode_all([seqs[3], seqs[1], seqs[2]]))
    report.checks.append(Check("decode", worst, worst <= tol, "4 rows of lengths 34..104, then a slot move"))

    prompt = rng.integers(0, vocab, 8).tolist()
    want_tokens = generate(model, [prompt], 64, temperature=0.0)[0]
    logits = runner.prefill_batch(0, [prompt])[0]
    tokens, seq = [], list(prompt)
    for _ in range(64):
        tokens.append(int(np.argmax(logits)))
        seq.append(tokens[-1])
        logits = runner.decode(np.array([tokens[-1]]), np.array([len(seq) - 1]))[0]
    same = tokens == want_tokens
    report.checks.append(Check("greedy", 0.0, same, f"64 tokens, {'identical' if same else 'DIFFERENT'} to PyTorch"))
    return report
