"""How held-out text is scored, shared by PyTorch training and ONNX checks. numpy only, no torch.

The validation stream is the held-out documents joined with EOS. It is cut into non-overlapping
windows of n_ctx tokens, so every token but the first is predicted exactly once. Bits per character
divides the total NLL (in bits) by the characters of the held-out text, so it does not depend on
the tokenizer.
"""

from __future__ import annotations

import math

import numpy as np

from service.runtime.tokenizer import Tokenizer

EVAL_BATCH = 16  # windows per forward pass


def encode_documents(tokenizer: Tokenizer, docs: list[str]) -> np.ndarray:
    """Concatenate documents into one id stream, each followed by EOS."""
    ids: list[int] = []
    for doc_ids in tokenizer.encode_batch(docs):
        ids.extend(doc_ids)
        ids.append(tokenizer.eos_id)
    return np.asarray(ids, dtype=np.int64)


def eval_batches(data: np.ndarray, n_ctx: int, max_windows: int | None = None):
    """Yield (inputs, targets) int64 arrays [B, n] over non-overlapping windows of `data`.

    With max_windows, an evenly spaced subset of the windows is used (for quick periodic checks).
    """
    starts = list(range(0, len(data) - 1, n_ctx))
    if max_windows is not None and len(starts) > max_windows:
        starts = [starts[i] for i in np.linspace(0, len(starts) - 1, max_windows).astype(int)]
    full = [s for s in starts if s + n_ctx < len(data)]
    groups = [(full[i: i + EVAL_BATCH], n_ctx) for i in range(0, len(full), EVAL_BATCH)]
    groups += [([s], len(data) - 1 - s) for s in starts if s + n_ctx >= len(data)]  # the short tail
    for group, n in groups:
        yield (np.stack([data[s: s + n] for s in group]), np.stack([data[s + 1: s + n + 1] for s in group]))


def bits_per_char(nats_per_token: float, n_tokens: int, n_chars: int) -> float:
    """Convert a mean token NLL to bits per character of the underlying text."""
    return nats_per_token * n_tokens / n_chars / math.log(2.0)


def nll_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood (nats) of `targets` [...] under numpy `logits` [..., vocab]."""
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    log_z = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
    return float((log_z - np.take_along_axis(z, targets[..., None], -1)[..., 0]).sum())
