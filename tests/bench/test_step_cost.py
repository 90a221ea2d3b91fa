"""bench/step_cost.py on the shipped model: the decode-only steps are found and their graph call is timed inside them."""

from __future__ import annotations

import json

from bench import step_cost


def test_a_decode_steps_graph_call_is_timed_inside_the_step(tmp_path):
    out = tmp_path / "cost.json"
    assert step_cost.main(["--batches", "1,2", "--prompt", "8", "--new-tokens", "6", "--repeats", "1",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["batches"]) == {"1", "2"}
    for row in result["batches"].values():
        assert row["steps"] == 5  # the first token comes from the prefill step; the other 5 from decode steps
        assert 0 < row["graph_ms"] <= row["step_ms"]
        assert row["python_ms"] >= 0 and 0 <= row["python_share"] < 1
