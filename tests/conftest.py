"""Shared fixtures: tiny models and tokenizers built inside the test, never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from model.config import GPTConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.tokenizer import Tokenizer, train_bpe  # noqa: E402

TINY_TEXTS = [
    "Rom.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n",
    "Ham.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "Mac.\nTomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day.\n",
] * 8


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(train_bpe(TINY_TEXTS, vocab_size=300, min_frequency=1))


def make_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    fields = dict(vocab_size=97, n_ctx=64, n_layer=2, n_head=4, d_model=32, dropout=0.0)
    fields.update(overrides)
    return GPT(GPTConfig(**fields)).eval()


@pytest.fixture
def tiny_model() -> GPT:
    return make_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved random model with a context long enough for export verification."""
    from model.checkpoint import save_model_dir

    path = tmp_path_factory.mktemp("model")
    save_model_dir(make_model(vocab_size=tiny_tokenizer.vocab_size, n_ctx=128), tiny_tokenizer, path)
    return path


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model exported with every graph variant."""
    from export.cli import export_bundle

    path = tmp_path_factory.mktemp("bundle")
    export_bundle(tiny_model_dir, path, name="tiny", optimized=True, int8=True, fp16=True)
    return path
