"""The start-up self-check: reduced-precision graphs and other providers must reproduce the fp32 graph."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from service.runtime.bundle import BundleError, read_manifest, write_manifest
from service.runtime.cpu import cpu_info
from service.runtime.probes import INVARIANCE_ROWS, PROBE_ROWS, PROBE_TOKENS, Agreement
from service.runtime.self_check import (
    MIN_AGREEMENT,
    MIN_KV_AGREEMENT,
    agreement,
    batch_invariance,
    check,
    probe_sequences,
    sample_probe,
)
from service.runtime.static_runner import StaticRunner


def test_the_fp32_graph_on_the_cpu_is_its_own_reference_and_batch_invariant(int8_bundle):
    result = check(StaticRunner(int8_bundle, "static", provider="cpu"))
    assert result.agreement is None
    assert result.invariance.identical and result.invariance.max_abs_diff == 0
    assert (result.invariance.rows, result.invariance.batch) == (len(INVARIANCE_ROWS), PROBE_ROWS)


def test_the_probe_is_text_the_reference_samples_from_a_document_start(int8_bundle):
    ref = StaticRunner(int8_bundle, "static", provider="cpu")
    seqs = probe_sequences(ref)
    eos = ref.manifest.model.eos_token_id
    assert seqs.shape == (PROBE_ROWS, PROBE_TOKENS) and (seqs[:, 0] == eos).all()
    assert len({tuple(r) for r in seqs}) == PROBE_ROWS  # rows differ
    np.testing.assert_array_equal(probe_sequences(ref), seqs)  # seeded: the same probe every start
    assert not ref.attached


def test_the_probe_keeps_the_logits_the_reference_sampled_it_from(int8_bundle):
    """They stand for the reference's own scoring: a prefill of the same positions rounds alike but for the
    last bits, so the reference agrees with itself on every position."""
    ref = StaticRunner(int8_bundle, "static", provider="cpu")
    probe = sample_probe(ref)
    assert probe.logits.shape == (PROBE_ROWS, PROBE_TOKENS, ref.vocab_size)
    itself = agreement(ref, ref, probe)
    assert itself.top1 == 1.0 and itself.max_abs_diff < 1e-4


def test_an_int8_graph_that_follows_fp32_passes(int8_bundle):
    runner = StaticRunner(int8_bundle, "static-int8", provider="cpu")
    result = check(runner)
    agreed = result.agreement
    assert agreed.positions == PROBE_ROWS * PROBE_TOKENS
    assert MIN_AGREEMENT["int8"] <= agreed.top1 and 0 < agreed.max_abs_diff  # close, yet not the fp32 graph renamed
    assert result.invariance.identical  # activations quantized per row: no row rounds by another's values
    assert not runner.attached  # nothing left attached: the engine attaches its own cache


def test_int8_with_one_activation_scale_per_batch_is_not_batch_invariant(per_tensor_bundle):
    runner = StaticRunner(per_tensor_bundle, "static-int8-per-tensor", provider="cpu")
    result = check(runner)
    assert result.agreement.top1 >= MIN_AGREEMENT["int8"]  # close to fp32 ...
    assert not result.invariance.identical and result.invariance.max_abs_diff > 0  # ... but not alone = batched
    assert "batch-invariant: no" in result.invariance.describe()


def test_the_invariance_probe_sees_a_row_that_depends_on_the_batch(int8_bundle):
    runner = StaticRunner(int8_bundle, "static", provider="cpu")
    probe = sample_probe(runner)
    assert batch_invariance(runner, probe).identical
    decode = runner.decode
    runner.decode = lambda ids, positions: decode(ids, positions) + np.float32(1e-6) * (len(ids) > 1)
    result = batch_invariance(runner, probe)
    assert not result.identical and 0 < result.max_abs_diff < 1e-5  # one ulp-sized nudge is enough


def test_a_reduced_graph_that_parts_from_fp32_is_refused_in_one_line(wrong_int8_bundle):
    runner = StaticRunner(wrong_int8_bundle, "static-int8", provider="cpu")
    with pytest.raises(BundleError) as e:
        check(runner)
    message = str(e.value)
    assert "\n" not in message
    measured = agreement(runner, StaticRunner(wrong_int8_bundle, "static", provider="cpu"),
                         least=MIN_AGREEMENT["int8"]).top1
    assert measured < MIN_AGREEMENT["int8"]
    for part in ("graph 'static-int8'", cpu_info().describe(), f"only {measured:.1%}", f"{MIN_AGREEMENT['int8']:.0%}",
                 "--graph static", "attnserve export --int8"):
        assert part in message


def test_scoring_stops_once_the_bar_is_out_of_reach():
    rows, tokens, vocab = 2, 10, 5
    want = np.zeros((rows, tokens, vocab), np.float32)
    want[..., 0] = 1  # the reference's top-1 is token 0 everywhere
    got = want.copy()
    got[:, :4, 1] = 2  # the candidate's first four positions of each row pick token 1
    scored, closed = [], []

    def chunks():
        try:
            for t in range(tokens):
                scored.append(t)
                yield got[:, t:t + 1]
        finally:
            closed.append(True)

    # after 3 positions of each row wrong, 14 of 20 can still agree (70%); after 4, at most 12
    result = Agreement.scored(chunks(), want, least=0.7)
    assert scored == [0, 1, 2, 3] and closed and not result.complete
    assert (result.positions, result.top1) == (rows * 4, 0.0)
    scored.clear()
    whole = Agreement.scored(chunks(), want)
    assert len(scored) == tokens and whole.complete and (whole.positions, whole.top1) == (rows * tokens, 0.6)


def test_a_failing_graph_is_refused_before_the_end_of_the_probe(wrong_int8_bundle):
    runner = StaticRunner(wrong_int8_bundle, "static-int8", provider="cpu")
    reference = StaticRunner(wrong_int8_bundle, "static", provider="cpu")
    probe = sample_probe(reference)
    whole = agreement(runner, reference, probe)
    assert whole.complete and whole.top1 < MIN_AGREEMENT["int8"]
    cut = agreement(runner, reference, probe, least=MIN_AGREEMENT["int8"])
    assert not cut.complete and cut.positions < whole.positions and cut.top1 < MIN_AGREEMENT["int8"]
    assert not runner.attached  # the scratch cache went with the scoring that stopped


def test_a_disagreeing_graph_is_served_when_the_override_asks_with_a_warning(wrong_int8_bundle, caplog):
    runner = StaticRunner(wrong_int8_bundle, "static-int8", provider="cpu")
    with caplog.at_level(logging.WARNING, logger="service.runtime.self_check"):
        result = check(runner, allow_low_agreement=True)
    assert result.agreement.top1 < MIN_AGREEMENT["int8"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "serving it anyway (allow_low_agreement)" in warning and "graph 'static-int8'" in warning


def test_another_provider_must_reproduce_the_cpu_logits(int8_bundle):
    faithful = StaticRunner(int8_bundle, "static", provider="cpu")
    faithful.provider = "CUDAExecutionProvider"  # as if onnxruntime had placed it on a GPU
    assert check(faithful).agreement.max_abs_diff < 1e-4  # the probe's decode steps against its prefill: rounding

    drifting = StaticRunner(int8_bundle, "static", provider="cpu")
    drifting.provider = "CUDAExecutionProvider"
    prefill = drifting.prefill_batch
    drifting.prefill_batch = lambda *a, **k: prefill(*a, **k) + 0.5
    with pytest.raises(BundleError, match="on CUDAExecutionProvider does not reproduce the CPU"):
        check(drifting)


def test_a_reduced_graph_without_an_fp32_graph_to_compare_is_refused(int8_bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(int8_bundle, dst)
    manifest = read_manifest(dst)
    manifest.graphs = {"static-int8": manifest.graphs["static-int8"]}
    manifest.default_graph = "static-int8"
    write_manifest(dst, manifest)
    with pytest.raises(BundleError, match="no fp32 static graph to compare it with"):
        check(StaticRunner(dst, "static-int8", provider="cpu"))


def test_a_kv_cache_that_disagrees_with_fp32_is_refused(lively_bundle, tmp_path):
    """An int8 cache whose scales are 10x too fine saturates (on the shipped model: 33% top-1 agreement); the
    calibrated one and the float16 one pass."""
    import onnx
    from onnx import numpy_helper

    for graph in ("static-kv16", "static-kv8"):
        runner = StaticRunner(lively_bundle, graph, provider="cpu")
        assert check(runner).agreement.top1 >= MIN_KV_AGREEMENT[runner.cache_shape.dtype]
    dst = tmp_path / "bundle"
    shutil.copytree(lively_bundle, dst)
    path = dst / read_manifest(dst).graphs["static-kv8"].file
    graph = onnx.load(str(path))
    for t in graph.graph.initializer:
        if t.name.endswith("_scale"):
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) / 10, t.name))
    onnx.save(graph, str(path))
    with pytest.raises(BundleError, match=r"graph 'static-kv8' \(float32 weights, int8 KV cache\) on this CPU .* at only "
                                          r"[\d.]+% of \d+ probe positions scored \(at least 95% is required; the rest could no longer reach it\); "
                                          r"serve --graph static --kv-dtype float32$"):
        check(StaticRunner(dst, "static-kv8", provider="cpu"))


def test_older_manifests_name_their_int8_graphs_by_file(tiny_bundle, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, dst)
    text = (dst / "bundle.json").read_text()
    (dst / "bundle.json").write_text(text.replace('"weights": "int8",', "").replace('"weights": "float32",', ""))
    graphs = read_manifest(dst).graphs
    assert graphs["static-int8"].weights == "int8" and graphs["static"].weights == "float32"
    assert graphs["fp16"].weights == "float16"
