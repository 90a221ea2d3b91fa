"""`attnserve bench priority`: its report on a made-up result, and a quick run that measures every case and
leaves docs/ alone."""

from __future__ import annotations

import pytest

from bench.commands import priority
from bench.machine import RESULTS_DIR, describe


def made_up() -> dict:
    case = dict(batch_tokens=2000, batch_s=4.0, batch_tokens_per_s=500.0)
    return {"machine": describe(), "command": "attnserve bench priority", "model": "tiny",
            "settings": dict(priority.DEFAULTS),
            "cases": {"alone": dict(batch_priority=None, ttft_s=[0.01, 0.02], ttft_p50_s=0.015, ttft_p99_s=0.02,
                                    batch_tokens=0, batch_s=0.0, batch_tokens_per_s=None),
                      "batch at priority 10": dict(batch_priority=10, ttft_s=[0.05] * 3, ttft_p50_s=0.05,
                                                   ttft_p99_s=0.05, **case),
                      "batch at priority 0": dict(batch_priority=0, ttft_s=[1.0, 2.0], ttft_p50_s=1.5, ttft_p99_s=1.99,
                                                  **case)}}


def test_the_report_has_a_row_per_case_with_its_percentiles_and_the_batchs_rate():
    md = priority.render(made_up())
    assert "| alone | 2 | 15.0 | 20.0 | — |" in md
    assert "| batch at priority 10 | 3 | 50.0 | 50.0 | 500 |" in md
    assert "| batch at priority 0 | 2 | 1500.0 | 1990.0 | 500 |" in md


@pytest.mark.slow
def test_a_quick_run_measures_every_case_and_writes_nothing(tiny_bundle, capsys):
    published = RESULTS_DIR / "priority.json"
    before = published.stat().st_mtime_ns if published.exists() else None
    assert priority.main(["--quick", "--no-write", "--bundle", str(tiny_bundle)]) == 0
    out = capsys.readouterr().out
    for case in ("alone", "batch at priority 10", "batch at priority 0"):
        assert f"| {case} | " in out
    assert (published.stat().st_mtime_ns if published.exists() else None) == before
