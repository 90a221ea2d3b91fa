"""The pieces behind the hostile-client limits, without a server: counting a JSON body on its bytes, the
log throttle for event-loop errors, and the connection caps fitted under the open-file limit."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import resource

import pytest

from service.fronts import file_handles
from service.fronts.http.json_body import count_outside_strings, depth
from service.logs import ThrottledLoopErrors

TRICKY = '[]{},"\\ aé\n'  # what a count on the bytes could mistake, and the escapes that hide it


def random_json(rng: random.Random, level: int = 0):
    kind = rng.random()
    if level > 4 or kind < 0.4:
        return rng.choice([None, rng.randint(-9, 9), "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 8)))])
    if kind < 0.7:
        return [random_json(rng, level + 1) for _ in range(rng.randint(0, 4))]
    return {"".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 4))): random_json(rng, level + 1)
            for _ in range(rng.randint(0, 4))}


def containers(value) -> int:
    if isinstance(value, dict):
        return 1 + sum(containers(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(containers(v) for v in value)
    return 0


def separators(value) -> int:
    """Commas the compact encoding puts between items and members."""
    if isinstance(value, dict):
        return max(len(value) - 1, 0) + sum(separators(v) for v in value.values())
    if isinstance(value, list):
        return max(len(value) - 1, 0) + sum(separators(v) for v in value)
    return 0


def test_the_count_on_the_bytes_skips_strings_however_they_are_escaped():
    rng = random.Random(0)
    for _ in range(2000):
        value = random_json(rng)
        raw = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        assert count_outside_strings(raw) == (containers(value), separators(value) + 1), raw


def test_depth_of_parsed_json():
    assert depth(1) == 0 and depth([]) == 1 and depth({"a": [[{}]]}) == 4


def test_event_loop_errors_are_logged_once_per_interval(caplog):
    handler = ThrottledLoopErrors(interval_s=3600)
    with caplog.at_level(logging.ERROR, logger="attnserve.server"):
        for _ in range(1000):
            handler(None, {"message": "socket.accept() out of system resource", "exception": OSError(24, "EMFILE")})
        handler(None, {"message": "another kind"})
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["socket.accept() out of system resource",
                                                                      "another kind"]


@pytest.fixture
def nofile(monkeypatch):
    """RLIMIT_NOFILE as a test sets it, without touching the process's own."""
    limits = {"soft": 1024, "hard": 1024}

    def getrlimit(which):
        return limits["soft"], limits["hard"]

    def setrlimit(which, value):
        if value[0] > limits["hard"]:
            raise ValueError("not allowed to raise maximum limit")
        limits["soft"] = value[0]
    monkeypatch.setattr(resource, "getrlimit", getrlimit)
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    return limits


def test_the_soft_file_limit_is_raised_for_the_caps(nofile):
    nofile.update(soft=1024, hard=1_048_576)
    assert file_handles.fit_connections(1000, fronts=2) == 1000
    assert nofile["soft"] == file_handles.handles_needed(1000, 2)


def test_caps_that_cannot_fit_the_hard_limit_are_lowered_with_a_warning(nofile, caplog):
    nofile.update(soft=1024, hard=1024)
    with caplog.at_level(logging.WARNING, logger="attnserve.server"):
        fitted = file_handles.fit_connections(1000, fronts=2)
    assert 0 < fitted < 1000 and file_handles.handles_needed(fitted, 2) <= 1024
    assert "max_connections lowered from 1000" in caplog.text and "ulimit" in caplog.text


def test_a_large_response_encoded_a_choice_at_a_time_is_the_same_json():
    from service.fronts.http.response_streams import json_pieces

    response = {"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": i, "text": f"é\"{i}", "logprobs": {"top_logprobs": [{"a": -1.5}]}} for i in range(5)],
        "usage": {"prompt_tokens": 3}}

    async def whole() -> bytes:
        return b"".join([piece async for piece in json_pieces(response)])
    assert json.loads(asyncio.run(whole())) == response
