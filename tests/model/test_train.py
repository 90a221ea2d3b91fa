"""The training loop on a tiny in-memory corpus: it learns, logs, resumes and reproduces."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from model.training.data import Corpus
from model.training.scoring import bits_per_char
from model.training.train import TrainConfig, lr_at, train
from tests.conftest import TINY_TEXTS

CORPUS = Corpus(train=TINY_TEXTS * 4, val=TINY_TEXTS[:3])


def tiny_config(out, **overrides) -> TrainConfig:
    fields = dict(out=str(out), vocab_size=300, n_layer=2, n_head=2, d_model=32, n_ctx=32, batch_size=8,
                  max_steps=40, warmup_steps=5, eval_interval=10, eval_windows=8, lr=3e-3, bf16=False, compile=False, threads=1)
    fields.update(overrides)
    return TrainConfig(**fields)


def weights(out):
    return load_file(str(out / "resume" / "model.safetensors"))


def test_schedule_warms_up_then_decays_to_min_lr():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(5.5e-4)
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 110))


def test_bits_per_char_converts_token_nats():
    assert bits_per_char(math.log(2), n_tokens=100, n_chars=100) == pytest.approx(1.0)
    assert bits_per_char(math.log(2) * 3, n_tokens=100, n_chars=300) == pytest.approx(1.0)


@pytest.mark.slow
def test_training_learns_and_writes_its_artifacts(tmp_path):
    result = train(tiny_config(tmp_path), corpus=CORPUS)
    log = json.loads((tmp_path / "training_log.json").read_text())
    history = log["history"]
    assert len(history) == 4
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.5
    assert result["val_bits_per_char"] == pytest.approx(log["result"]["val_bits_per_char"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "loss_curve.png", "README.md"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "loss_curve.png").read_bytes().startswith(b"\x89PNG")
    card = (tmp_path / "README.md").read_text()
    assert f"{result['val_bits_per_char']:.4f}" in card and "attnserve train --out" in card


@pytest.mark.slow
def test_same_seed_gives_the_same_model_and_resume_continues_exactly(tmp_path):
    train(tiny_config(tmp_path / "a"), corpus=CORPUS)
    train(tiny_config(tmp_path / "b"), corpus=CORPUS)
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all((a[k] == b[k]).all() for k in a)

    stopped = train(tiny_config(tmp_path / "c", stop_at=20), corpus=CORPUS)
    assert stopped == {"stopped_at": 20}
    train(tiny_config(tmp_path / "c"), resume=True, corpus=CORPUS)
    c = weights(tmp_path / "c")
    assert all((a[k] == c[k]).all() for k in a)
    history = json.loads((tmp_path / "c" / "training_log.json").read_text())["history"]
    assert [h["step"] for h in history] == [10, 20, 30, 40]


@pytest.mark.slow
def test_best_checkpoint_is_kept(tmp_path):
    # A learning rate this high blows up (the loss grows ~10x a step, then turns NaN): the kept model
    # is from the best validation step, not the last.
    train(tiny_config(tmp_path, optimizer="adamw", lr=30.0, warmup_steps=1, min_lr=30.0), corpus=CORPUS)
    history = json.loads((tmp_path / "training_log.json").read_text())["history"]
    best = min((h for h in history if not math.isnan(h["val_loss"])), key=lambda h: h["val_loss"])
    final = json.loads((tmp_path / "training_log.json").read_text())["result"]["val_nats_per_token"]
    assert best["step"] != history[-1]["step"]
    assert final == pytest.approx(best["val_loss"], rel=1e-4)


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    from model.training.train import make_optimizers
    from tests.conftest import make_model

    model = make_model()
    adamw, muon = make_optimizers(model, TrainConfig(optimizer="muon"))
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    adamw_ids = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert muon_ids == {id(b.attn.qkv_proj.weight) for b in model.blocks} | {
        id(m.weight) for b in model.blocks for m in (b.attn.out_proj, b.ffn.fc_in, b.ffn.fc_out)}
    assert id(model.tok_emb.weight) in adamw_ids and not muon_ids & adamw_ids
    assert len(muon_ids) + len(adamw_ids) == len(list(model.parameters()))
    assert len(make_optimizers(model, TrainConfig(optimizer="adamw"))) == 1
    with pytest.raises(ValueError, match="optimizer"):
        make_optimizers(model, TrainConfig(optimizer="sgd"))


@pytest.mark.slow
def test_the_llama_architecture_trains_and_its_directory_exports(tmp_path):
    """--arch llama: rotary positions, RMSNorm, SwiGLU, grouped-query attention; it learns, and the model
    directory it writes exports and verifies like the GPT's."""
    from export.bundle_writer import export_bundle
    from export.verify import verify_static
    from model.checkpoint import load_model_dir

    train(tiny_config(tmp_path / "model", arch="llama", n_ctx=128), corpus=CORPUS)  # verify_static needs 104 positions
    history = json.loads((tmp_path / "model" / "training_log.json").read_text())["history"]
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.5
    model, _ = load_model_dir(tmp_path / "model")
    c = model.config
    assert (c.pos_encoding, c.norm, c.mlp, c.kv_heads, c.ff_width) == ("rotary", "rmsnorm", "swiglu", 1, 128)
    assert "--arch llama" in (tmp_path / "model" / "README.md").read_text()
    export_bundle(tmp_path / "model", tmp_path / "bundle", name="llama")
    assert verify_static(model, tmp_path / "bundle").passed


@pytest.mark.slow
def test_the_candidate_with_the_lower_bits_per_char_ships_with_both_figures_on_its_card(tmp_path):
    from model.training.pick_default import pick

    runs = {arch: tmp_path / arch for arch in ("gpt", "llama")}
    results = {arch: train(tiny_config(out, arch=arch, max_steps=steps), corpus=CORPUS)
               for (arch, out), steps in zip(runs.items(), (10, 40), strict=True)}
    better = min(results, key=lambda a: results[a]["val_bits_per_char"])
    shipped = tmp_path / "default"
    assert pick(list(runs.values()), shipped) == runs[better]
    assert (shipped / "model.safetensors").read_bytes() == (runs[better] / "model.safetensors").read_bytes()
    card = (shipped / "README.md").read_text()
    for arch, result in results.items():
        assert f"{result['val_bits_per_char']:.4f}" in card
        assert f"--arch {arch}" in card or arch == "gpt"
    assert f"**{results[better]['val_bits_per_char']:.4f}**" in card and "## Why this model" in card
