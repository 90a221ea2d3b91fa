"""The serving runner's contract: which graphs it takes, and errors that say what to do."""

from __future__ import annotations

import json
import shutil

import pytest

from service.engine.config import EngineConfig
from service.engine.core import Engine
from service.runtime.bundle import BundleError
from service.runtime.concat_runner import ConcatRunner
from service.runtime.static_runner import CacheShape, StaticRunner


def test_runner_takes_the_static_graph_by_default(tiny_bundle):
    r = StaticRunner(tiny_bundle, provider="cpu")
    assert r.graph_name == "static" and r.spec.cache == "static"
    assert r.cache_shape == CacheShape(n_layer=2, n_head=4, d_head=8, max_seq=128)


def test_standard_runner_still_takes_the_concat_graph(tiny_bundle):
    assert ConcatRunner(tiny_bundle, provider="cpu").spec.cache == "concat"


@pytest.mark.parametrize("runner,graph,match", [(StaticRunner, "fp32", "has a concat KV cache; this runner needs a static"),
                                                (ConcatRunner, "static", "has a static KV cache; this runner needs a concat")])
def test_a_graph_of_the_other_layout_is_refused(tiny_bundle, runner, graph, match):
    with pytest.raises(BundleError, match=match):
        runner(tiny_bundle, graph=graph, provider="cpu")


def test_a_bundle_without_a_serving_graph_says_how_to_fix_it(tiny_bundle, tmp_path):
    dst = tmp_path / "old"
    shutil.copytree(tiny_bundle, dst)
    manifest = json.loads((dst / "bundle.json").read_text())
    manifest["graphs"] = {k: v for k, v in manifest["graphs"].items() if v.get("cache") != "static"}
    manifest["default_graph"] = "fp32"
    (dst / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="no graph with a static KV cache .* re-export"):
        StaticRunner(dst, provider="cpu")


def test_kv_capacity_follows_the_memory_budget(tiny_bundle, caplog):
    shape = StaticRunner(tiny_bundle, provider="cpu").cache_shape
    assert shape.bytes_per_slot == 2 * 2 * 4 * 128 * 8 * 4
    caplog.set_level("INFO", logger="service.engine.core")
    engine = Engine(EngineConfig(bundle=tiny_bundle, max_running=32, kv_cache_bytes=5 * shape.bytes_per_slot,
                                 prefix_caching=False))
    assert engine.kv.n_slots == 32 and engine.kv.n_blocks * engine.kv.block_tokens == 5 * shape.max_seq
    assert engine.kv.nbytes == 5 * shape.bytes_per_slot
    # reported at start-up: the budget and where it went, and the tokens that fit
    assert "memory budget" in caplog.text and "physical memory" in caplog.text or "cgroup" in caplog.text
    assert f"KV cache: {5 * shape.max_seq} tokens" in caplog.text and "5.0 full contexts" in caplog.text
    # the prefix cache keeps its blocks in the same budget, up to all of it
    engine = Engine(EngineConfig(bundle=tiny_bundle, max_running=32, kv_cache_bytes=9 * shape.bytes_per_slot))
    assert engine.prefixes.n_blocks == engine.kv.n_blocks and engine.prefixes.nbytes == 0
    assert f"prefix cache: up to {9 * shape.max_seq} tokens of it" in caplog.text


def test_config_rejects_a_budget_with_no_room_for_prefill(engine_bundle):
    with pytest.raises(ValueError, match="max_batch_tokens .* must exceed max_running"):
        EngineConfig(bundle=engine_bundle, max_running=64, max_batch_tokens=64)
