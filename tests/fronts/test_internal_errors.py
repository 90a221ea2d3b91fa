"""A fault that is not the client's, in the engine or in a front, fails only the request it struck: 500 /
INTERNAL with a short message that names the request id, the details in the log under that id and never
in the response; the requests beside it finish whole, and the server keeps serving.

The fault is injected for one prompt (VICTIM) while requests for another prompt run in the same batches."""

from __future__ import annotations

import json
import logging
import threading

import grpc
import pytest

from service.client import Client
from service.fronts.http import openai_responses
from tests.fronts.server_harness import ServerThread, engine_for, free_port, settings, slowed, wait_until

httpx2 = pytest.importorskip("httpx2")

VICTIM, OTHER = "Ham.", "Rom."
SECRET = "Parser Error: <state> secret internals"  # what the injected fault says: never shown to a client
OTHERS, OTHER_TOKENS = 4, 60


def is_victim(prompt_token_ids: list[int], victim_ids: list[int]) -> bool:
    return list(prompt_token_ids) == victim_ids


def engine_faults(victim_ids: list[int]):
    """For `engine_for`: each decode step slowed (the others are still running when the victim comes), and
    the output step raises for the victim's request."""
    def wrap(engine):
        slowed(0.01)(engine)
        original = engine.output._update

        def update(seq, *args):
            if is_victim(seq.request.prompt_token_ids, victim_ids):
                raise RuntimeError(SECRET)
            return original(seq, *args)

        engine.output._update = update
    return wrap


@pytest.fixture(scope="module")
def victim_ids(engine_bundle) -> list[int]:
    from service.runtime.tokenizer import Tokenizer

    return Tokenizer.from_file(engine_bundle / "tokenizer.json").encode(VICTIM)


@pytest.fixture(scope="module")
def faulty_server(engine_bundle, victim_ids):
    s = settings(engine_bundle, http_port=free_port())
    with ServerThread(s, engine_for(s, engine_faults(victim_ids))) as srv:
        yield srv


def assert_short(message: str, request_id: str) -> None:
    assert message.startswith("internal error: ") and f"request {request_id}" in message, message
    assert SECRET not in message and "<state>" not in message and "Traceback" not in message, message
    assert "RuntimeError" not in message, message


def run_others(srv) -> tuple[list, list[threading.Thread]]:
    """OTHERS gRPC requests of OTHER_TOKENS tokens each, started on threads; returns (results, threads)."""
    results: list = []

    def one(seed: int) -> None:
        with Client(srv.address, timeout_s=120) as c:
            results.append(c.generate(OTHER, max_new_tokens=OTHER_TOKENS, ignore_eos=True, seed=seed))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(OTHERS)]
    for t in threads:
        t.start()
    with Client(srv.address) as c:
        wait_until(lambda: c.server_info().requests_running == OTHERS, timeout=60, what="the others to run")
    return results, threads


def assert_others_whole(results: list, threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(120)
    assert len(results) == OTHERS
    assert all(len(r.completions[0].token_ids) == OTHER_TOKENS for r in results)


def test_an_engine_fault_fails_only_its_request_on_both_fronts(faulty_server, caplog):
    caplog.set_level(logging.ERROR)
    results, threads = run_others(faulty_server)
    with Client(faulty_server.address, timeout_s=60) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(VICTIM, max_new_tokens=8, request_id="victim-grpc")
    assert e.value.code() is grpc.StatusCode.INTERNAL
    assert_short(e.value.details(), "victim-grpc")
    with httpx2.Client(base_url=faulty_server.http_url, timeout=60) as h:
        body = {"model": "", "prompt": VICTIM, "max_tokens": 8}
        whole = h.post("/v1/completions", json=body, headers={"X-Request-Id": "victim-http"})
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error", whole.text
        assert_short(whole.json()["error"]["message"], "victim-http")
        streamed = h.post("/v1/completions", json={**body, "stream": True}, headers={"X-Request-Id": "victim-sse"})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert events and "error" in events[-1], streamed.text
        assert_short(events[-1]["error"]["message"], "victim-sse")
    assert_others_whole(results, threads)
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert SECRET in logged and "victim-grpc" in logged and "victim-http" in logged
    with Client(faulty_server.address, timeout_s=60) as c:  # still serving
        assert len(c.generate(OTHER, max_new_tokens=5, ignore_eos=True).completions[0].token_ids) == 5


@pytest.fixture
def front_fault(monkeypatch, victim_ids):
    """The HTTP front's response builder raises for the victim's request."""
    original = openai_responses.ResponseBuilder._add

    def add(self, stream_index, events):
        if is_victim(self.accepted_requests[0].request.prompt_token_ids, victim_ids):
            raise RuntimeError(SECRET)
        return original(self, stream_index, events)

    monkeypatch.setattr(openai_responses.ResponseBuilder, "_add", add)


@pytest.mark.parametrize("stream", [False, True])
def test_a_front_fault_is_a_short_500_and_the_others_finish(faulty_server, front_fault, stream, caplog):
    caplog.set_level(logging.ERROR)
    results, threads = run_others(faulty_server)
    with httpx2.Client(base_url=faulty_server.http_url, timeout=60) as h:
        ok = h.post("/v1/completions", json={"prompt": OTHER, "max_tokens": 3, "stream": stream})
        assert ok.status_code == 200, ok.text
        r = h.post("/v1/completions", json={"prompt": VICTIM, "max_tokens": 8, "stream": stream},
                   headers={"X-Request-Id": "front-victim"})
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        message = events[-1]["error"]["message"]
    else:
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
    assert_short(message, "front-victim")
    assert_others_whole(results, threads)
    assert any(SECRET in (rec.getMessage() + (rec.exc_text or "")) for rec in caplog.records)
