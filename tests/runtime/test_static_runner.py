"""The serving runner's contract: which graphs it takes, and errors that say what to do."""

from __future__ import annotations

import json
import shutil

import pytest

from service.engine.config import EngineConfig
from service.engine.core import Engine
from service.engine.kv_cache import plan_slots
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
    assert plan_slots(shape, 64, None) == 64
    assert plan_slots(shape, 64, 10 * shape.bytes_per_slot + 1) == 10
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        plan_slots(shape, 64, shape.bytes_per_slot - 1)
    caplog.set_level("INFO", logger="service.engine.core")
    engine = Engine(EngineConfig(bundle=tiny_bundle, max_running=32, kv_cache_bytes=5 * shape.bytes_per_slot,
                                 prefix_caching=False))
    assert engine.kv.n_slots == 5 and engine.kv.nbytes == 5 * shape.bytes_per_slot
    assert f"({5 * shape.bytes_per_slot} bytes)" in caplog.text  # reported at start-up, in bytes
    # the prefix cache (4 contexts by default) comes out of the same budget, and is reported beside it
    engine = Engine(EngineConfig(bundle=tiny_bundle, max_running=32, kv_cache_bytes=9 * shape.bytes_per_slot))
    assert engine.prefixes.nbytes == 4 * shape.bytes_per_slot and engine.kv.n_slots == 5
    assert f"prefix cache: {4 * shape.max_seq // 16} blocks x 16 positions" in caplog.text


def test_config_rejects_a_budget_with_no_room_for_prefill(engine_bundle):
    with pytest.raises(ValueError, match="max_batch_tokens .* must exceed max_running"):
        EngineConfig(bundle=engine_bundle, max_running=64, max_batch_tokens=64)
