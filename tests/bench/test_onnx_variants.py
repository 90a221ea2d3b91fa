"""The graph-variant benchmark drives static-cache and concat-cache graphs alike: same model, same logits."""

from __future__ import annotations

import numpy as np
import pytest

from bench.commands.onnx_variants import ConcatGraph, StaticGraph, open_graph
from service.runtime.bundle import read_manifest


@pytest.fixture(scope="module")
def graphs(tiny_bundle) -> tuple[StaticGraph, ConcatGraph]:
    manifest = read_manifest(tiny_bundle)
    return (open_graph(tiny_bundle, "static", manifest.graphs["static"], threads=1),
            open_graph(tiny_bundle, "fp32", manifest.graphs["fp32"], threads=1))


def test_each_graph_gets_the_runner_of_its_cache_layout(graphs):
    static, concat = graphs
    assert isinstance(static, StaticGraph) and isinstance(concat, ConcatGraph)


def test_windows_score_alike(graphs):
    static, concat = graphs
    windows = np.random.default_rng(0).integers(0, static.model.vocab_size, (3, 40))
    want = concat.window_logits(windows)
    got = static.window_logits(windows)
    assert got.shape == want.shape == (3, 40, static.model.vocab_size)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


def test_greedy_decode_alike(graphs):
    static, concat = graphs
    prompt = np.random.default_rng(1).integers(0, static.model.vocab_size, 16).tolist()
    a, b = static.prefill(prompt), concat.prefill(prompt)
    for position in range(16, 24):
        np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max())
        token = int(np.argmax(b))
        a, b = static.decode(token, position), concat.decode(token, position)
