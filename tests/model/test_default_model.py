"""The default model that ships in models/shakespeare: complete, and as good as its card says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_model_dir
from model.training.data import load_corpus
from model.training.scoring import bits_per_char, encode_documents
from model.training.train import evaluate

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "shakespeare"
TARGET_BITS_PER_CHAR = 2.10


def test_model_directory_is_complete_and_small():
    names = {"config.json", "model.safetensors", "tokenizer.json", "README.md", "training_log.json", "loss_curve.png"}
    assert names <= {p.name for p in MODEL_DIR.iterdir()}
    size = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert size <= 30_000_000


@pytest.mark.slow
@pytest.mark.corpus
def test_held_out_bits_per_char_meets_the_target_and_matches_the_card():
    model, tokenizer = load_model_dir(MODEL_DIR)
    corpus = load_corpus()
    val_ids = encode_documents(tokenizer, corpus.val)
    with torch.no_grad():
        nats = evaluate(model, val_ids, model.config.n_ctx, None, bf16=False)
    bpc = bits_per_char(nats, len(val_ids) - 1, corpus.val_chars)
    logged = json.loads((MODEL_DIR / "training_log.json").read_text())["result"]["val_bits_per_char"]
    assert bpc == pytest.approx(logged, abs=1e-3)
    assert bpc <= TARGET_BITS_PER_CHAR
    assert f"{logged:.4f}" in (MODEL_DIR / "README.md").read_text()


def test_generate_local_cli_prints_a_continuation():
    out = subprocess.run(
        [sys.executable, "-m", "attnserve", "generate-local", "Rom.", "--model", str(MODEL_DIR),
         "--max-new-tokens", "24", "--seed", "1"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    assert out.startswith("Rom.") and len(out) > len("Rom.") + 20
