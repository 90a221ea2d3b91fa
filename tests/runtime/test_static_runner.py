"""The serving runner's contract: which graphs it takes, and errors that say what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from service.engine.config import EngineConfig
from service.engine.core import Engine
from service.runtime.bundle import LOGITS_INDEX, BundleError, read_manifest
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


def _prompts(runner: StaticRunner, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, runner.vocab_size, n).tolist() for n in lengths]


def test_the_head_runs_only_where_logits_are_read(tiny_bundle):
    runner = StaticRunner(tiny_bundle, provider="cpu")
    assert runner.reads_logits_index
    prompts = _prompts(runner, [7, 33, 1])
    with runner.scratch_cache(3):
        every = runner.prefill_batch(0, prompts, every_position=True)
        last = runner.prefill_batch(0, prompts)
        long = _prompts(runner, [40], seed=1)[0]
        runner.prefill(0, long[:24], 0)
        chunk_every = runner.prefill(0, long[24:], 24, every_position=True)
        chunk_last = runner.prefill(0, long[24:], 24)
    assert every.shape == (3, 33, runner.vocab_size) and last.shape == (3, runner.vocab_size)
    for i, p in enumerate(prompts):  # the same bits as the row's last position among every position's
        assert np.array_equal(last[i], every[i, len(p) - 1])
    assert chunk_every.shape == (16, runner.vocab_size) and np.array_equal(chunk_last, chunk_every[-1])


def without_logits_index(bundle: Path, out: Path, graph: str = "static") -> None:
    """`bundle` copied to `out` with its `graph` as exported before LOGITS_INDEX: the head over every position."""
    import onnx  # the export install's (the tests that build bundles have it)

    shutil.copytree(bundle, out)
    path = out / read_manifest(out).graphs[graph].file
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    gather = next(n for n in g.node if n.op_type == "GatherND")
    read = next(n for n in g.node if n.output[0] == gather.input[1])
    for n in g.node:  # the head reads the final hidden states themselves
        n.input[:] = [gather.input[0] if name == gather.output[0] else name for name in n.input]
    g.node.remove(gather)
    g.node.remove(read)
    g.input.remove(next(i for i in g.input if i.name == LOGITS_INDEX))
    onnx.save(model, str(path))


def test_a_graph_exported_before_logits_index_is_still_served(tiny_bundle, tmp_path):
    without_logits_index(tiny_bundle, tmp_path / "old")
    old, new = StaticRunner(tmp_path / "old", provider="cpu"), StaticRunner(tiny_bundle, provider="cpu")
    assert not old.reads_logits_index
    prompts = _prompts(new, [5, 20])
    got = {}
    for name, runner in (("old", old), ("new", new)):
        with runner.scratch_cache(2):
            got[name] = (runner.prefill_batch(0, prompts), runner.prefill_batch(0, prompts, every_position=True),
                         runner.prefill(1, prompts[0], 20), runner.decode(np.array([3, 4]), np.array([5, 25])).copy())
    for a, b in zip(got["old"], got["new"], strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
