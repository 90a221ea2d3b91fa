"""`attnserve bench memory --quick` on the tiny bundle: every part runs or says why it was skipped, every request of
every workload completes, and the section has the parts' tables."""

from __future__ import annotations

import json

import pytest

from bench.commands import memory
from bench.peers import llama_cpp

pytestmark = pytest.mark.slow  # starts three servers


@pytest.fixture(scope="module")
def quick_run(tiny_bundle, tmp_path_factory):
    out = tmp_path_factory.mktemp("memory")
    code = memory.main(["--quick", "--bundle", str(tiny_bundle), "--out", str(out)])
    return code, json.loads((out / "memory.json").read_text())


def test_every_request_completes_within_the_budget(quick_run):
    code, result = quick_run
    assert code == 0, result["checks"]
    for part in ("server", "beside", "budget"):
        (run,) = result[part]["runs"]
        assert run["plan"]["kv_tokens"] == run["plan"]["server_info_kv_tokens"] > 0  # the log and GetServerInfo agree
        assert run["within_budget"]
        for phase in memory.flat_phases(run["phases"]):
            assert phase["completed"] == phase["requests"] and not phase["errors"]
    # whether the streams still ran when the long prompt arrived is timing (a tiny model's streams end in ms): reported
    assert "sent_while_streams_ran" in result["beside"]["runs"][0]["phases"]["long_beside_streams"]
    assert result["budget"]["runs"][0]["budget_bytes"] == 2**30


def test_the_mechanism_compares_both_layouts_and_gives_pages_back(quick_run):
    _, result = quick_run
    decode, release = result["mechanism"]["decode"], result["mechanism"]["release"]
    assert set(decode["median_ms"]) == {"lazy pages (now)", "allocated once (before)"}
    assert set(decode["speed_ratio"]) == {"16", "32"}
    assert release["rss_released"] <= release["rss_written"]
    assert release["release_ms"] > 0


def test_missing_programs_and_bundles_are_skipped_with_the_reason(quick_run):
    _, result = quick_run
    reason = llama_cpp.available()
    if reason:  # not built here; with the programs, the tiny bundle has no Hugging Face directory beside it
        assert result["llama"]["skipped"] == reason
    else:
        assert "Hugging Face directory" in result["llama"]["skipped"]
    assert "--long-bundle" in result["long-context"]["skipped"]
    section = memory.render(result)
    assert section.startswith("## KV memory") and "Skipped:" in section
