"""The .proto contract: stubs committed and current, every rpc and field documented."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "protos"))

from build import build, proto_files  # noqa: E402


def test_committed_stubs_match_the_protos(tmp_path):
    pytest.importorskip("grpc_tools")
    for fresh in build(tmp_path):
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run 'make protos'"
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run 'make protos'"


def test_every_rpc_field_and_value_has_a_doc_comment():
    for path in proto_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            code = line.strip()
            if re.match(r"(rpc |message |enum )", code) or re.match(r"(optional |repeated )?[\w.]+ \w+ = \d+;", code) \
                    or re.match(r"[A-Z_]+ = \d+;", code):
                assert lines[i - 1].strip().startswith("///"), f"{path.name}:{i + 1} has no /// comment: {code}"


def test_the_public_names_are_as_documented():
    from attnserve.v1 import generate_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["TextGeneration"]
    assert [m.name for m in service.methods] == ["Generate", "GenerateStream", "Tokenize", "GetModelInfo",
                                                 "GetServerInfo", "ListModels", "LoadModel", "UnloadModel"]
    assert [f.name for f in pb.LoadModelRequest.DESCRIPTOR.fields] == ["model"]
    assert [f.name for f in pb.UnloadModelRequest.DESCRIPTOR.fields] == ["model"]
    assert pb.ModelInfo.DESCRIPTOR.fields_by_name["state"].number == 17
    assert [f.name for f in pb.GenerateRequest.DESCRIPTOR.fields] == [
        "request_id", "prompt", "prompt_token_ids", "sampling", "stopping", "n", "top_logprobs", "echo", "logprobs",
        "truncate_prompt", "prompt_logprobs", "beam_width", "length_penalty", "beam_stopping", "priority", "model",
        "json_schema", "json_object", "regex", "choice", "grammar"]
    logit_bias = pb.SamplingParams.DESCRIPTOR.fields_by_name["logit_bias"]
    assert logit_bias.message_type.GetOptions().map_entry  # token id -> bias
    assert [v.name for v in pb.BeamStopping.DESCRIPTOR.values] == [
        "BEAM_STOPPING_HEURISTIC", "BEAM_STOPPING_EARLY", "BEAM_STOPPING_NEVER"]
    assert pb.Completion.DESCRIPTOR.fields_by_name["beam_score"].has_presence
    assert [f.name for f in pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["constraint"].fields] == [
        "json_schema", "json_object", "regex", "choice", "grammar"]
    assert [v.name for v in pb.FinishReason.DESCRIPTOR.values] == [
        "FINISH_REASON_UNSPECIFIED", "FINISH_REASON_LENGTH", "FINISH_REASON_EOS_TOKEN", "FINISH_REASON_STOP_SEQUENCE"]
    temperature = pb.SamplingParams.DESCRIPTOR.fields_by_name["temperature"]
    assert temperature.has_presence  # unset is told apart from 0 (greedy)
