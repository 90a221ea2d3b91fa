"""`--graph auto`: the fastest graph that passes the self-check, only the picks checked; a named graph must
pass it too."""

from __future__ import annotations

import logging

import pytest

from service.runtime import graph_choice
from service.runtime.bundle import BundleError
from service.runtime.graph_choice import Candidate, choose, open_serving_graph


def choice_line(caplog) -> str:
    [line] = [r.getMessage() for r in caplog.records if "graph choice on" in r.getMessage()]
    return line


def test_auto_measures_every_serving_graph_and_says_which_it_serves(int8_bundle, caplog):
    with caplog.at_level(logging.INFO, logger="service.runtime.graph_choice"):
        runner = open_serving_graph(int8_bundle, max_batch=4)
    assert runner.graph_name in ("static", "static-int8") and not runner.attached
    line = choice_line(caplog)
    assert f"serving {runner.graph_name} (" in line
    assert "static (float32): " in line and "static-int8 (int8): " in line and "at batch 4" in line


def test_auto_self_checks_only_the_graph_it_picks(int8_bundle, graph_times, monkeypatch, caplog):
    checked = []
    check = graph_choice.check

    def counted(runner, *args, **kwargs):
        checked.append(runner.graph_name)
        return check(runner, *args, **kwargs)

    monkeypatch.setattr(graph_choice, "check", counted)
    graph_times({"static-int8": 1.0})
    with caplog.at_level(logging.INFO, logger="service.runtime.graph_choice"):
        assert open_serving_graph(int8_bundle, max_batch=4).graph_name == "static-int8"
    assert checked == ["static-int8"]
    line = choice_line(caplog)
    assert "serving static-int8 (int8): 1.00 ms at batch 1, 1.00 ms at batch 4; top-1 agreement" in line
    assert "static (float32): 10.00 ms at batch 1, 10.00 ms at batch 4; not checked" in line


def test_auto_never_serves_a_graph_that_fails_the_self_check(wrong_int8_bundle, graph_times, caplog):
    graph_times({"static-int8": 1.0})  # picked first, refused, then the next pick is checked
    with caplog.at_level(logging.INFO, logger="service.runtime.graph_choice"):
        runner = open_serving_graph(wrong_int8_bundle, max_batch=4)
    assert runner.graph_name == "static"
    assert any("not serving static-int8" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert "serving static (float32): 10.00 ms at batch 1, 10.00 ms at batch 4; batch-invariant (the only one left" \
        in choice_line(caplog)


def test_auto_never_serves_a_graph_that_is_not_batch_invariant(per_tensor_bundle, graph_times, caplog):
    graph_times({"static-int8-per-tensor": 1.0})
    with caplog.at_level(logging.INFO, logger="service.runtime.graph_choice"):
        runner = open_serving_graph(per_tensor_bundle, max_batch=4)
    assert runner.graph_name in ("static", "static-int8")
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "not serving static-int8-per-tensor: it is not batch-invariant on this CPU" in warning
    assert "name it with --graph" in warning
    line = choice_line(caplog)
    assert "static-int8 (int8): " in line and "batch-invariant" in line and "per-tensor" not in line


def test_a_named_graph_that_is_not_batch_invariant_is_served_with_one_warning(per_tensor_bundle, caplog):
    with caplog.at_level(logging.INFO, logger="service.runtime.graph_choice"):
        runner = open_serving_graph(per_tensor_bundle, graph="static-int8-per-tensor")
    assert runner.graph_name == "static-int8-per-tensor"
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "graph static-int8-per-tensor is not batch-invariant" in warning and "\n" not in warning


def test_a_named_graph_wins_but_must_pass_the_self_check(wrong_int8_bundle):
    assert open_serving_graph(wrong_int8_bundle, graph="static").graph_name == "static"
    with pytest.raises(BundleError, match="graph 'static-int8' .* agrees with the fp32 graph 'static'"):
        open_serving_graph(wrong_int8_bundle, graph="static-int8")
    # unless asked to serve it anyway; auto never does
    runner = open_serving_graph(wrong_int8_bundle, graph="static-int8", allow_low_agreement=True)
    assert runner.graph_name == "static-int8"
    assert open_serving_graph(wrong_int8_bundle, max_batch=4, allow_low_agreement=True).graph_name != "static-int8"


def test_a_bundle_with_one_serving_graph_is_served_without_timing(plain_bundle, caplog):
    with caplog.at_level(logging.INFO, logger="service.runtime.graph_choice"):
        assert open_serving_graph(plain_bundle).graph_name == "static"
    assert "serving static (float32): not timed; batch-invariant (the bundle's only serving graph" in \
        choice_line(caplog)


def test_a_concat_graph_cannot_be_served(tiny_bundle):
    with pytest.raises(BundleError, match="graph 'fp32' has a concat KV cache; this runner needs a static one"):
        open_serving_graph(tiny_bundle, graph="fp32")


def test_the_kv_cache_type_is_asked_for_never_chosen_by_timing(lively_bundle, caplog):
    assert open_serving_graph(lively_bundle, max_batch=4).spec.cache_dtype == "float32"  # unless asked
    with caplog.at_level(logging.INFO, logger="service.runtime.graph_choice"):
        runner = open_serving_graph(lively_bundle, max_batch=4, kv_dtype="float16")
    assert runner.graph_name in ("static-kv16", "static-int8-kv16") and runner.cache_shape.dtype == "float16"
    [line] = [r.getMessage() for r in caplog.records if "graph choice on" in r.getMessage()]
    assert f"serving {runner.graph_name} (" in line and "float16 KV cache" in line and "kv8" not in line


def test_a_named_graph_must_keep_the_kv_cache_asked_for(lively_bundle):
    with pytest.raises(BundleError, match="graph 'static-kv16' keeps its KV cache in float16, not float32: serve it "
                                          "with --kv-dtype float16"):
        open_serving_graph(lively_bundle, graph="static-kv16")
    assert open_serving_graph(lively_bundle, graph="static-kv16", kv_dtype="float16").graph_name == "static-kv16"


def test_a_bundle_without_the_kv_cache_asked_for_says_how_to_write_it(int8_bundle):
    with pytest.raises(BundleError, match=r"has no serving graph whose KV cache is int8 \(it has static \(float32\), "
                                          r"static-int8 \(float32\)\); re-export it with 'attnserve export --kv-dtype "
                                          "int8'"):
        open_serving_graph(int8_bundle, kv_dtype="int8")


class FakeRunner:
    def __init__(self, name: str, weights: str):
        self.graph_name, self.spec = name, type("Spec", (), {"weights": weights})()


def candidate(name: str, weights: str, b1_ms: float, b32_ms: float) -> Candidate:
    return Candidate(FakeRunner(name, weights), None, {1: b1_ms, 32: b32_ms})


def test_the_fastest_wins_by_the_geometric_mean_of_its_step_times():
    fp32, int8 = candidate("static", "float32", 2.0, 8.0), candidate("static-int8", "int8", 1.0, 8.0)
    assert choose([fp32, int8]) is int8  # 2x at batch 1, even at 32: sqrt(2) faster overall
    slow_at_32 = candidate("static-int8", "int8", 1.0, 40.0)
    assert choose([fp32, slow_at_32]) is fp32  # 2x faster at batch 1 does not pay for 5x slower at 32


def test_near_ties_go_to_the_more_precise_graph_so_restarts_agree():
    fp32, int8 = candidate("static", "float32", 2.0, 8.0), candidate("static-int8", "int8", 1.9, 7.9)
    assert choose([int8, fp32]) is fp32
    int4 = candidate("static-int4", "int4", 1.0, 8.0)
    int8_close = candidate("static-int8", "int8", 1.05, 8.0)
    assert choose([int4, int8_close, fp32]) is int8_close
