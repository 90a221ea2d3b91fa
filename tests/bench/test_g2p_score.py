"""`attnserve score-g2p`: the served G2P model's test scores, each graph greedy and with beams, into its card."""

from __future__ import annotations

import json

import pytest

from bench import g2p_score
from export.seq2seq_bundle import export_seq2seq_bundle

pytestmark = pytest.mark.needs_torch("trains a G2P model")


@pytest.mark.slow
def test_every_graph_and_beam_width_is_scored_into_the_card(short_g2p_run, tmp_path):
    out, log = short_g2p_run
    export_seq2seq_bundle(out, tmp_path / "bundle", int8=True)
    assert g2p_score.main(["--model", str(out), "--bundle", str(tmp_path / "bundle"), "--beams", "1", "2"]) == 0
    scores = json.loads((out / "scores.json").read_text())
    cells = {(r["graph"], r["beam"]): r for r in scores["served"]}
    assert set(cells) == {(g, b) for g in ("static", "static-int8") for b in (1, 2)}
    assert all(r["words"] == 50 and 0 <= r["wer"] <= 1 for r in scores["served"])
    # the fp32 pair, greedy, is PyTorch's greedy decoding, so it scores as training scored it (within a word
    # or two: an untrained model's near-ties may fall either way at 1e-6)
    assert cells["static", 1]["wer"] == pytest.approx(log["result"]["test_wer"], abs=2 / 50)
    card = (out / "README.md").read_text()
    assert "| `static-int8` (int8) |" in card and "beam 2" in card and "## Runs" in card
    assert f"{out.name} (this model)" in card
