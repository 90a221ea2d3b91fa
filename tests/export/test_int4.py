"""The 4-bit serving graph (`--int4`): MatMulNBits weights, the serving contract unchanged, checked like INT8."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest

from export.bundle_writer import GRAPH_FILES, export_bundle
from export.variants import INT4, quantization
from service.runtime.bundle import read_manifest
from service.runtime.graph_choice import open_serving_graph
from service.runtime.self_check import MIN_AGREEMENT, check, logits_at_every_position, probe_sequences
from service.runtime.static_runner import StaticRunner
from tests.engine.harness import greedy as greedy_request
from tests.engine.harness import run_alone

# The bound on |Δlogits| of the 4-bit graph against fp32 on the probe, as a share of the largest fp32 logit.
# Each 4-bit weight is rounded to 1/15 of its block's range; on the tiny random model the largest difference
# measures 8% of the largest logit (INT8: 1.3%) on an AVX-512 VNNI CPU, and the AVX2 kernel differs from that
# by about 1% (docs/onnx.md), so 15% holds on every CPU with room to spare.
MAX_RELATIVE_LOGIT_DIFF = 0.15


@pytest.fixture(scope="module")
def int4_bundle(tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp("int4_bundle")
    export_bundle(tiny_model_dir, path, int8=True, int4=INT4, keep_fp32=False)
    return path


def test_int4_is_a_serving_graph_in_the_manifest(int4_bundle):
    m = read_manifest(int4_bundle)
    assert set(m.graphs) == {"static", "static-int8", "static-int4", "int8"}
    spec = m.graphs["static-int4"]
    assert (spec.file, spec.cache, spec.dtype, spec.weights) == ("model.static.int4.onnx", "static", "float32", "int4")
    assert spec.inputs == m.graphs["static"].inputs and spec.outputs == m.graphs["static"].outputs


def test_int4_graph_multiplies_by_4_bit_blocks_with_int8_activations(int4_bundle):
    graph = onnx.load(str(int4_bundle / GRAPH_FILES["static-int4"])).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) >= 2 * 3 + 1  # per layer: the packed QKV, the output and the MLP projections; the logits head
    for node in nbits:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, INT4.block_size, 4)
    float_weights = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2}
    assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in float_weights]


def test_int4_logits_stay_close_to_fp32_and_pass_the_self_check(int4_bundle):
    ref = StaticRunner(int4_bundle, "static", provider="cpu")
    int4 = StaticRunner(int4_bundle, "static-int4", provider="cpu")
    seqs = probe_sequences(ref)
    want, got = logits_at_every_position(ref, seqs), logits_at_every_position(int4, seqs)
    diff = np.abs(got - want).max()
    assert 0 < diff <= MAX_RELATIVE_LOGIT_DIFF * np.abs(want).max()  # close, and not the fp32 graph renamed
    result = check(int4, ref)
    assert result.agreement.top1 >= MIN_AGREEMENT["int4"]


def runner_greedy(runner: StaticRunner, prompt: list[int], n: int) -> list[int]:
    """A plain greedy loop over the runner: one prefill, then one decode step per token."""
    with runner.scratch_cache(1, len(prompt) + n):
        out = [int(runner.prefill_batch(0, [prompt]).argmax(-1)[0])]
        while len(out) < n:
            out.append(int(runner.decode(np.array(out[-1:]), np.array([len(prompt) + len(out) - 1])).argmax(-1)[0]))
    return out


def test_the_engine_decodes_greedily_with_the_int4_graph(int4_bundle, make_engine):
    prompt = [5, 9, 17, 33, 2, 8]
    want = runner_greedy(StaticRunner(int4_bundle, "static-int4", provider="cpu"), prompt, 12)
    run = run_alone(make_engine, greedy_request("a", prompt, 12, ignore_eos=True), bundle=int4_bundle,
                    graph="static-int4")
    assert run.tokens("a") == want


def test_auto_times_the_int4_graph_among_the_others(int4_bundle, caplog, tmp_path):
    """Timed with the others on every CPU; whether it is then served is the probe's call on this CPU (on AVX2
    alone its 4-bit kernel is not batch-invariant, and the warning says so)."""
    with caplog.at_level(logging.INFO, logger="service.runtime.graph_choice"):
        runner = open_serving_graph(int4_bundle, max_batch=4, cache_dir=tmp_path)
    [kept] = [json.loads(p.read_text())["choice"] for p in tmp_path.rglob("*.json")]
    assert {"static", "static-int4"} <= set(kept["step_ms"])  # what was timed, whatever is served
    [line] = [m for m in caplog.messages if m.startswith("graph choice on ")]
    assert f"serving {runner.graph_name} (" in line
    refusals = [m for m in caplog.messages if m.startswith("graph choice: not serving static-int4: ")]
    if runner.graph_name != "static-int4":  # measured beside the one served, or refused with the reason
        assert "static-int4 (int4): " in line or (refusals and "static-int4" in kept["refused"])
    for refusal in refusals:  # not batch-invariant here (an AVX2-only CPU): the way out is named
        assert "--int4-block-size 16" in refusal


def test_block_sizes_are_read_from_the_candidate_name():
    q = quantization("nbits4-int8-b64")
    assert (q.bits, q.block_size, q.accuracy_level, q.weights) == (4, 64, 4, "int4")
    assert quantization("nbits4-fp32").block_size == 32
    for wrong in ("nbits4-int8-b24", "nbits4-int8-b8", "u8s8-b32", "nbits5-int8"):
        with pytest.raises(ValueError):
            quantization(wrong)


def test_a_block_16_graph_is_written_on_request_and_batch_invariant(tiny_model_dir, tmp_path):
    """`--int4-block-size 16`: the 4-bit graph whose rows keep to themselves on AVX2-only CPUs too, where block 32's
    one-row kernel rounds otherwise (docs/onnx.md); measured on AVX2 and AVX-512 VNNI kernels, not on AMX."""
    from export.cli import main as export_main
    from service.runtime.cpu import cpu_info

    out = tmp_path / "b16"
    assert export_main([str(tiny_model_dir), "-o", str(out), "--int4", "--int4-block-size", "16"]) == 0
    graph = onnx.load(str(out / GRAPH_FILES["static-int4"])).graph
    sizes = {onnx.helper.get_attribute_value(a) for n in graph.node if n.op_type == "MatMulNBits"
             for a in n.attribute if a.name == "block_size"}
    assert sizes == {16} and "block 16," in read_manifest(out).graphs["static-int4"].description
    result = check(StaticRunner(out, "static-int4", provider="cpu"))
    assert result.agreement.top1 >= MIN_AGREEMENT["int4"]
    if "amx_tile" in cpu_info().flags:
        pytest.skip("block 16's batch invariance is measured on AVX2 and AVX-512 VNNI kernels, not AMX's")
    assert result.invariance.identical, result.invariance.describe()
