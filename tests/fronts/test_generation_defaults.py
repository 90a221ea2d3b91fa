"""The sampling defaults a bundle's generation_config.json sets for the fields a request leaves unset."""

from __future__ import annotations

import json

from service.fronts.generation_defaults import sampling_defaults


def write(tmp_path, config) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))


def test_no_file_no_defaults(tmp_path):
    assert sampling_defaults(tmp_path) == {}


def test_do_sample_false_makes_the_default_greedy(tmp_path):
    write(tmp_path, {"do_sample": False, "temperature": 0.7, "eos_token_id": 2})
    assert sampling_defaults(tmp_path) == {"temperature": 0.0}


def test_stated_values_are_taken_and_others_left_alone(tmp_path):
    write(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None, "max_length": 20})
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9}


def test_out_of_range_or_unreadable_values_fall_back(tmp_path, caplog):
    write(tmp_path, {"temperature": -1.0, "repetition_penalty": 1.1})
    assert sampling_defaults(tmp_path) == {"repetition_penalty": 1.1}
    assert "temperature" in caplog.text
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}
