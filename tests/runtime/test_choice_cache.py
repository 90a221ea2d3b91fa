"""The cache of graph choices: a restart on the same bundle, CPU and settings serves the graph chosen before
without checking or timing anything; anything else that changed, or a cache file that cannot be used, means
measuring again."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from service.runtime import choice_cache, graph_choice
from service.runtime.choice_cache import CHOICE_DIR
from service.runtime.graph_choice import open_serving_graph
from tests.conftest import SHIPPED_BUNDLE


@pytest.fixture
def measured(monkeypatch) -> list[str]:
    """The graphs self-checked (and "timing" for each time the candidates are timed), in order."""
    log: list[str] = []
    check, time_decode = graph_choice.check, graph_choice.time_decode

    def counted_check(runner, *args, **kwargs):
        log.append(runner.graph_name)
        return check(runner, *args, **kwargs)

    def counted_timing(candidates, batch):
        log.append("timing")
        time_decode(candidates, batch)

    monkeypatch.setattr(graph_choice, "check", counted_check)
    monkeypatch.setattr(graph_choice, "time_decode", counted_timing)
    return log


@pytest.fixture
def bundle(tmp_path) -> Path:
    """A copy of the shipped bundle, free to change."""
    return Path(shutil.copytree(SHIPPED_BUNDLE, tmp_path / "bundle"))


def serve(bundle: Path, cache: Path, **kwargs) -> str:
    return open_serving_graph(bundle, **{"max_batch": 4, "threads": 1, **kwargs}, cache_dir=cache).graph_name


def entries(cache: Path) -> list[Path]:
    return sorted((cache / CHOICE_DIR).glob("*.json"))


def test_a_restart_serves_the_cached_graph_alone_without_measuring(tmp_path, measured, monkeypatch, caplog):
    cache = tmp_path / "cache"
    first = serve(SHIPPED_BUNDLE, cache)
    assert measured[0] == "timing" and measured[1:] and len(entries(cache)) == 1
    measured.clear()
    opened = []
    runner = graph_choice.StaticRunner

    def opening(bundle, name, *args, **kwargs):
        opened.append(name)
        return runner(bundle, name, *args, **kwargs)

    monkeypatch.setattr(graph_choice, "StaticRunner", opening)
    with caplog.at_level(logging.INFO, logger="service.runtime.graph_choice"):
        assert serve(SHIPPED_BUNDLE, cache) == first
    assert measured == [] and opened == [first]
    [line] = [r.getMessage() for r in caplog.records if "graph choice on" in r.getMessage()]
    assert f"serving {first} (" in line and "not checked again" in line and str(entries(cache)[0]) in line
    assert "batch-invariant" in line


def test_a_named_graph_is_cached_as_well(tmp_path, measured):
    cache = tmp_path / "cache"
    assert serve(SHIPPED_BUNDLE, cache, graph="static-int8") == "static-int8"
    assert measured == ["static-int8"]
    assert serve(SHIPPED_BUNDLE, cache, graph="static-int8") == "static-int8" and measured == ["static-int8"]
    assert serve(SHIPPED_BUNDLE, cache, graph="static") == "static" and measured[-1] == "static"  # another entry
    assert len(entries(cache)) == 2


@pytest.mark.parametrize("change", ["graph file", "manifest"])
def test_a_changed_bundle_is_measured_again(bundle, tmp_path, measured, caplog, change):
    cache = tmp_path / "cache"
    serve(bundle, cache)
    measured.clear()
    if change == "graph file":  # another graph where the INT8 one was: a re-export
        shutil.copyfile(bundle / "model.static.onnx", bundle / "model.static.int8.onnx")
    else:
        manifest = json.loads((bundle / "bundle.json").read_text())
        manifest["graphs"]["static-int8"]["description"] += " (re-exported)"
        (bundle / "bundle.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.INFO, logger="service.runtime.choice_cache"):
        serve(bundle, cache)
    assert measured[0] == "timing" and measured[1:]
    changed = "model.static.int8.onnx" if change == "graph file" else "bundle.json"
    assert f"the bundle changed since it was checked ({changed})" in caplog.text
    measured.clear()
    serve(bundle, cache)
    assert measured == []  # the new outcome replaced the old one


def test_the_weights_a_graph_keeps_beside_it_are_part_of_the_bundle(bundle, tmp_path, measured, caplog):
    """A graph exported with its weights in `<file>.data` (ONNX external data): new weights there, under the
    same graph file, are a new bundle."""
    cache = tmp_path / "cache"
    weights = bundle / "model.static.int8.onnx.data"
    weights.write_bytes(b"weights")
    serve(bundle, cache)
    measured.clear()
    weights.write_bytes(b"others!")
    with caplog.at_level(logging.INFO, logger="service.runtime.choice_cache"):
        serve(bundle, cache)
    assert measured and "the bundle changed since it was checked (model.static.int8.onnx.data)" in caplog.text


def test_a_file_written_again_with_the_same_bytes_is_still_the_same_bundle(bundle, tmp_path, measured):
    cache = tmp_path / "cache"
    serve(bundle, cache)
    measured.clear()
    graph = bundle / "model.static.int8.onnx"
    graph.write_bytes(graph.read_bytes())  # new times, same contents: hashed again, found the same
    serve(bundle, cache)
    assert measured == []


def test_another_cpu_or_other_settings_are_measured_again(tmp_path, measured, monkeypatch):
    cache = tmp_path / "cache"
    serve(SHIPPED_BUNDLE, cache)
    serve(SHIPPED_BUNDLE, cache, max_batch=8)
    assert measured.count("timing") == 2  # the timing batch is part of the key
    fingerprint = choice_cache.cpu_fingerprint()
    monkeypatch.setattr(choice_cache, "cpu_fingerprint",
                        lambda: {**fingerprint, "cpu_flags": [*fingerprint["cpu_flags"], "amx_tile"]})
    serve(SHIPPED_BUNDLE, cache)
    assert measured.count("timing") == 3 and len(entries(cache)) == 3


@pytest.mark.parametrize("damage", ["not JSON", "truncated", "another shape", "a graph without a verdict",
                                    "a verdict of other types", "a graph the bundle lacks", "another key"])
def test_a_cache_file_that_cannot_be_used_is_ignored_and_replaced(tmp_path, measured, caplog, damage):
    cache = tmp_path / "cache"
    serve(SHIPPED_BUNDLE, cache)
    [entry] = entries(cache)
    text = entry.read_text()
    data = json.loads(text)
    if damage == "not JSON":
        entry.write_bytes(b"\x00\xff garbage")
    elif damage == "truncated":
        entry.write_text(text[:len(text) // 2])
    elif damage == "another shape":
        entry.write_text(json.dumps({**data, "choice": [1, 2, 3], "bundle": "x"}))
    elif damage == "a graph without a verdict":
        entry.write_text(json.dumps({**data, "choice": {**data["choice"], "served": "static-int4"}}))
    elif damage == "a verdict of other types":
        verdict = data["choice"]["checked"][data["choice"]["served"]]
        verdict["invariance"]["identical"] = "yes"
        entry.write_text(json.dumps(data))
    elif damage == "a graph the bundle lacks":
        served = data["choice"]["served"]
        checked = {**data["choice"]["checked"], "static-int9": data["choice"]["checked"][served]}
        entry.write_text(json.dumps({**data, "choice": {**data["choice"], "served": "static-int9", "checked": checked}}))
    else:
        entry.write_text(json.dumps({**data, "key": {**data["key"], "check_code": "0" * 64}}))
    measured.clear()
    with caplog.at_level(logging.INFO, logger="service.runtime.choice_cache"):
        serve(SHIPPED_BUNDLE, cache)
    assert measured[0] == "timing"
    assert f"ignoring the cache file {entry}" in caplog.text
    assert json.loads(entry.read_text())["key"] == data["key"]
    measured.clear()
    serve(SHIPPED_BUNDLE, cache)
    assert measured == []


def test_recheck_measures_again_and_replaces_the_entry(tmp_path, measured):
    cache = tmp_path / "cache"
    serve(SHIPPED_BUNDLE, cache)
    [entry] = entries(cache)
    before = json.loads(entry.read_text())
    measured.clear()
    serve(SHIPPED_BUNDLE, cache, recheck=True)
    assert measured[0] == "timing"
    assert json.loads(entry.read_text())["key"] == before["key"]


def test_a_cache_folder_that_cannot_be_written_costs_a_warning_not_the_start(tmp_path, measured, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="service.runtime.choice_cache"):
        assert serve(SHIPPED_BUNDLE, blocked / "cache")
    assert "cannot write the cache file" in caplog.text and "ATTNSERVE_CACHE_DIR" in caplog.text


def test_a_graph_that_fails_its_check_is_not_cached(wrong_int8_bundle, tmp_path):
    from service.runtime.bundle import BundleError

    cache = tmp_path / "cache"
    with pytest.raises(BundleError, match="agrees with the fp32 graph"):
        serve(wrong_int8_bundle, cache, graph="static-int8")
    assert entries(cache) == []


def test_a_graph_served_despite_its_agreement_is_warned_about_at_every_start(wrong_int8_bundle, tmp_path, caplog):
    cache = tmp_path / "cache"
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert serve(wrong_int8_bundle, cache, graph="static-int8", allow_low_agreement=True) == "static-int8"
        assert "serving it anyway (allow_low_agreement)" in caplog.text
    assert "when it was checked" in caplog.text  # the second start read it from the cache
