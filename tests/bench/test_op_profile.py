"""`python -m bench.op_profile`: the operators of a decode step and of a chunked prefill, from onnxruntime's profiler."""

from __future__ import annotations

from bench.op_profile import main


def test_a_chunked_prefill_is_profiled_by_operator(tiny_bundle, capsys):
    assert main(["--bundle", str(tiny_bundle), "--graphs", "static,static-int8", "--prefill", "40",
                 "--chunk", "16", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill of 40 tokens in chunks of 16" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "GroupQueryAttention" in rows and "MatMulIntegerToFloat" in rows
    assert rows["MatMulIntegerToFloat"].split("|")[2].strip().startswith("0.00")  # the fp32 graph has none


def test_decode_steps_are_profiled_by_operator(tiny_bundle, capsys):
    assert main(["--bundle", str(tiny_bundle), "--graphs", "static", "--batches", "1,2", "--steps", "2",
                 "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "batch 1: kernel µs per decode step" in out and "batch 2: kernel µs per decode step" in out
    assert "GroupQueryAttention" in out
