"""logit_bias and priority over both fronts: gRPC's `sampling.logit_bias` map and HTTP's OpenAI-style
`logit_bias` (token ids as string keys) ban and force tokens on /v1/completions and /v1/chat/completions;
bad keys, ids and biases are 400 / INVALID_ARGUMENT naming the entry; `priority` is taken by both fronts
and checked; and a priority-0 request queued behind priority-10 ones is admitted before them."""

from __future__ import annotations

import threading
from collections import Counter

import grpc
import pytest

from service.client import Client, build_request
from tests.engine.harness import Gate
from tests.fronts.server_harness import (
    ServerThread,
    engine_for,
    settings,
    templated_server,
    wait_until,
)
from tests.fronts.test_http_api import CHATML, oai, raw

PROMPT = [5, 6, 7]
N, TOKENS = 8, 125  # 1,000 sampled tokens in one request
HTTP_TOKENS = 40  # per choice, short enough for a chat prompt beside it in the test model's context


@pytest.fixture(scope="module")
def srv(engine_bundle, tmp_path_factory):
    with templated_server(engine_bundle, tmp_path_factory.mktemp("bias"), CHATML) as s:
        yield s


def grpc_tokens(srv: ServerThread, **fields) -> list[list[int]]:
    with Client(srv.address, timeout_s=120) as client:
        response = client.generate(PROMPT, n=N, max_new_tokens=TOKENS, temperature=1.0, seed=9, ignore_eos=True,
                                   **fields)
    return [list(c.token_ids) for c in response.completions]


def http_tokens(srv: ServerThread, endpoint: str, **fields) -> list[list[str]]:
    """Each choice's tokens as OpenAI names them (their text), from its logprobs."""
    with oai(srv) as api:
        if endpoint == "completions":
            body = {"prompt": PROMPT, "logprobs": 0}
        else:
            body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        answer = api.post(f"/{endpoint}", body={**body, "n": N, "max_tokens": HTTP_TOKENS, "temperature": 1.0,
                                                "seed": 9, "ignore_eos": True, **fields}, cast_to=object)
    if endpoint == "completions":
        return [c["logprobs"]["tokens"] for c in answer["choices"]]
    return [[entry["token"] for entry in c["logprobs"]["content"]] for c in answer["choices"]]


def test_grpc_bans_a_token_over_a_thousand_sampled_tokens_and_forces_another(srv):
    free = grpc_tokens(srv)
    banned, seen = Counter(t for c in free for t in c).most_common(1)[0]
    assert seen >= 10
    tokens = [t for c in grpc_tokens(srv, logit_bias={banned: -100.0}) for t in c]
    assert len(tokens) == N * TOKENS and banned not in tokens
    forced = 3 if banned != 3 else 4
    assert grpc_tokens(srv, logit_bias={forced: 100.0}) == [[forced] * TOKENS] * N


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_http_bans_and_forces_tokens_with_string_keys(srv, endpoint):
    texts = srv.server.serving.default.texts
    free = http_tokens(srv, endpoint)
    name, seen = Counter(t for c in free for t in c).most_common(1)[0]
    assert seen >= 5
    banned = [t for t in range(srv.server.engine.engine.sampleable) if texts.openai(t)[0] == name]
    tokens = [t for c in http_tokens(srv, endpoint, logit_bias={str(t): -100 for t in banned}) for t in c]
    assert len(tokens) == N * HTTP_TOKENS and name not in tokens
    forced = next(t for t in range(3, 100) if texts.openai(t)[0] != name)
    assert http_tokens(srv, endpoint, logit_bias={str(forced): 100}) == [[texts.openai(forced)[0]] * HTTP_TOKENS] * N


@pytest.mark.parametrize("logit_bias, param, says", [
    ({"abc": 1}, "logit_bias.abc", "is not a token id"),
    ({"1.5": 1}, "logit_bias.1.5", "is not a token id"),
    ({"-1": 1}, "logit_bias.-1", "is not a token id"),
    ({"5": 1, "05": 2}, "logit_bias.05", "which another key names too"),
    ({"5": 100.5}, "logit_bias.5", "100.5 is outside [-100, 100]"),
    ({"5": "x"}, "logit_bias.5", 'must be a number; got "x"'),
    ({"5": True}, "logit_bias.5", "must be a number; got true"),
    ({"300000": 1}, "logit_bias.300000", "is outside the vocabulary"),
    ([5], "logit_bias", "must be an object"),
])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_http_refuses_a_bad_logit_bias_naming_the_entry(srv, endpoint, logit_bias, param, says):
    base = {"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = raw(srv, "POST", endpoint, {**base, "max_tokens": 2, "logit_bias": logit_bias})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ": ") and says in error["message"], error


def test_a_non_finite_bias_is_refused_by_name(srv):
    r = raw(srv, "POST", "/v1/completions", '{"prompt": [5, 6], "max_tokens": 2, "logit_bias": {"5": 1e999}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias.5", r.text
    assert "not a finite number" in r.json()["error"]["message"]
    with Client(srv.address, timeout_s=60) as client, pytest.raises(grpc.RpcError) as e:
        client.generate(PROMPT, max_new_tokens=2, logit_bias={5: float("nan")})
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sampling.logit_bias.5: ") and "not a finite number" in e.value.details()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_http_takes_a_priority_and_refuses_one_out_of_range_or_not_an_integer(srv, endpoint):
    base = {"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    for priority in (-(2**31), 0, 7, 2**31 - 1):
        r = raw(srv, "POST", endpoint, {**base, "max_tokens": 2, "priority": priority})
        assert r.status_code == 200 and r.json()["choices"], r.text
    for priority, says in ((2**31, "is outside [-2147483648, 2147483647]"), (1.5, "must be an integer"),
                           ("1", "must be an integer")):
        r = raw(srv, "POST", endpoint, {**base, "max_tokens": 2, "priority": priority})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "priority" and says in error["message"], error


def test_grpc_takes_a_priority(srv):
    with Client(srv.address, timeout_s=60) as client:
        for priority in (-(2**31), -1, 0, 2**31 - 1):
            assert len(client.generate(PROMPT, max_new_tokens=2, priority=priority).completions[0].token_ids) == 2


def test_a_priority_0_request_queued_after_priority_10_ones_is_admitted_before_them(engine_bundle):
    """One slot, held by a running request (the engine thread held at its first decode) while three priority-10
    requests and then a priority-0 one are submitted. The urgent one is admitted next, before the three that
    arrived earlier: it waited less than any of them (each waited for the urgent one to finish, though it
    arrived before it), which holds whatever the timings; in arrival order it would have waited the longest."""
    s = settings(engine_bundle, max_running=1, max_batch_tokens=64, warmup=False)
    gates = []
    engine = engine_for(s, lambda e: gates.append(Gate(e, at=1)))
    long = dict(max_new_tokens=12, ignore_eos=True, temperature=0.0)
    with ServerThread(s, engine) as srv, Client(srv.address, timeout_s=120) as c:
        holder = c.stub.Generate.future(build_request(PROMPT, priority=10, **long))
        gates[0].wait_reached_sync()
        calls = {}
        for rid, priority in (("b10", 10), ("c10", 10), ("d10", 10), ("urgent", 0)):
            calls[rid] = c.stub.Generate.future(build_request(PROMPT, request_id=rid, priority=priority, **long))
            waiting = len(calls)
            wait_until(lambda w=waiting: c.server_info().requests_waiting == w, what=f"{rid} to queue")
        gates[0].open()
        assert len(holder.result(120).completions[0].token_ids) == 12
        queued_ms = {rid: call.result(120).usage.queue_ms for rid, call in calls.items()}
    assert queued_ms["urgent"] < min(queued_ms[rid] for rid in ("b10", "c10", "d10")), queued_ms


def test_requests_of_every_priority_finish_under_concurrent_load(srv):
    """Mixed priorities submitted at once from several threads all complete, each with its tokens."""
    results: dict[int, int] = {}

    def one(priority: int) -> None:
        with Client(srv.address, timeout_s=120) as client:
            results[priority] = len(client.generate(PROMPT, max_new_tokens=6, ignore_eos=True,
                                                    priority=priority).completions[0].token_ids)

    threads = [threading.Thread(target=one, args=(p,)) for p in (-5, 0, 3, 10, 2**31 - 1, -(2**31))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == dict.fromkeys((-5, 0, 3, 10, 2**31 - 1, -(2**31)), 6)
