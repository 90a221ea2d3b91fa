"""Every error path of the gRPC server: invalid fields, overload, deadlines, cancellation, model faults.

Where timing would decide the outcome, the engine thread is held at a known model call (`Gate`),
or each decode step is slowed so a deadline or a cancel lands mid-generation; every check of a
freed slot polls with a bound instead of sleeping a fixed time.
"""

from __future__ import annotations

import math
import threading

import grpc
import pytest

from attnserve.v1 import generate_pb2 as pb
from service.client import Client, build_request
from service.fronts.status import RETRY_AFTER_KEY
from tests.engine.harness import Gate
from tests.fronts.server_harness import ServerThread, engine_for, settings, slowed, wait_until

CODE = grpc.StatusCode


def all_free(client: Client) -> bool:
    info = client.server_info()
    return info.requests_running == 0 and info.requests_waiting == 0 and info.kv_free_slots == info.kv_slots


# entries that depend on the model are functions of (vocab_size, n_ctx), resolved from the engine bundle
INVALID = [
    ("sampling.temperature", dict(temperature=-1.0)),
    ("sampling.temperature", dict(temperature=math.nan)),
    ("sampling.temperature", dict(temperature=math.inf)),
    ("sampling.temperature", dict(temperature=101.0)),
    ("sampling.top_p", dict(top_p=0.0)),
    ("sampling.top_p", dict(top_p=1.5)),
    ("sampling.top_k", lambda vocab, n_ctx: dict(top_k=vocab + 1)),
    ("sampling.min_p", dict(min_p=2.0)),
    ("sampling.repetition_penalty", dict(repetition_penalty=0.0)),
    ("sampling.presence_penalty", dict(presence_penalty=3.0)),
    ("sampling.frequency_penalty", dict(frequency_penalty=-3.0)),
    ("stopping.max_new_tokens", lambda vocab, n_ctx: dict(max_new_tokens=n_ctx)),
    ("stopping.max_new_tokens", dict(max_new_tokens=2**32 - 1)),
    ("stopping.min_new_tokens", dict(max_new_tokens=4, min_new_tokens=5)),
    ("stopping.stop", dict(stop=[f"s{i}" for i in range(17)])),
    ("stopping.stop[1]", dict(stop=["a", ""])),
    ("stopping.stop[0]", dict(stop=["x" * 300])),
    ("stopping.stop_token_ids[0]", lambda vocab, n_ctx: dict(stop_token_ids=[vocab])),
    ("n", dict(n=17)),
    ("n", dict(n=9)),  # more than this server's max_running (8)
    ("top_logprobs", dict(top_logprobs=21)),
    ("request_id", dict(request_id="has space")),
    ("request_id", dict(request_id="x" * 129)),
    ("request_id", dict(request_id="tab\there")),
]


@pytest.mark.parametrize("field,fields", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_field_is_named_with_its_range(client, engine_model, field, fields):
    if callable(fields):
        fields = fields(engine_model.vocab_size, engine_model.n_ctx)
    for rpc in (client.stub.Generate, lambda r, **kw: list(client.stub.GenerateStream(r, **kw))):
        with pytest.raises(grpc.RpcError) as e:
            rpc(build_request("Rom.", **fields), timeout=30)
        assert e.value.code() is CODE.INVALID_ARGUMENT
        assert e.value.details().startswith(field + ":"), e.value.details()
    numeric = not any(isinstance(v, (str, list)) for v in fields.values()) and "n" != field
    if numeric and "nan" not in repr(fields) and "inf" not in repr(fields):
        assert "outside" in e.value.details() or "exceed the context of" in e.value.details()


@pytest.mark.parametrize("max_new", ["context", "room + 1"])
def test_prompt_and_max_new_tokens_past_the_context_say_both_and_the_context(client, engine_model, max_new):
    """The limit is the context less the prompt: a 5-token prompt leaves room for n_ctx - 5 new tokens."""
    n_ctx = engine_model.n_ctx
    max_new_tokens = n_ctx if max_new == "context" else n_ctx - 4
    with pytest.raises(grpc.RpcError) as e:
        client.generate([5] * 5, max_new_tokens=max_new_tokens)
    assert e.value.code() is CODE.INVALID_ARGUMENT
    assert f"prompt 5 tokens + max_new_tokens {max_new_tokens} exceed the context of {n_ctx}" in e.value.details()
    assert f"lower max_new_tokens to at most {n_ctx - 5}" in e.value.details()
    assert len(client.generate([5] * 5, max_new_tokens=n_ctx - 5, ignore_eos=True).completions[0].token_ids) \
        == n_ctx - 5


@pytest.mark.parametrize("request_,field", [
    (pb.GenerateRequest(prompt="Rom.", prompt_token_ids=[5, 6]), "prompt"),
    (pb.GenerateRequest(), "prompt"),
    (lambda vocab, n_ctx: pb.GenerateRequest(prompt_token_ids=[5, vocab]), "prompt_token_ids[1]"),
    (pb.GenerateRequest(prompt_token_ids=[2**32 - 1]), "prompt_token_ids[0]"),
    (lambda vocab, n_ctx: pb.GenerateRequest(prompt_token_ids=[5] * (n_ctx - 8),
                                             stopping=pb.StoppingCriteria(max_new_tokens=20)), "prompt"),
    (pb.GenerateRequest(prompt="Rom. " * 3000), "prompt"),
])
def test_prompt_errors(client, engine_model, request_, field):
    if callable(request_):
        request_ = request_(engine_model.vocab_size, engine_model.n_ctx)
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Generate(request_, timeout=30)
    assert e.value.code() is CODE.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()


def test_an_oversized_message_is_refused_and_the_server_carries_on(client):
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Generate(pb.GenerateRequest(prompt="x" * (5 * 2**20)), timeout=30)
    assert e.value.code() is CODE.RESOURCE_EXHAUSTED
    assert client.generate("Rom.", max_new_tokens=3).completions[0].token_ids


def test_overload_is_resource_exhausted_with_a_retry_hint(engine_bundle):
    s = settings(engine_bundle, max_running=2, max_waiting=1, max_batch_tokens=64, warmup=False)
    gates = []  # the first decode (the first request alone), then the first decode of two rows
    engine = engine_for(s, lambda e: gates.extend([Gate(e, at=1), Gate(e, at=1, when=lambda ids: len(ids) == 2)]))
    with ServerThread(s, engine) as srv, Client(srv.address, timeout_s=60) as c:
        alone, both = gates
        long = dict(max_new_tokens=40, ignore_eos=True, seed=1)
        running = [c.stub.Generate.future(build_request("Rom.", **long))]
        alone.wait_reached_sync()  # held, the first request cannot finish before the second arrives
        running.append(c.stub.Generate.future(build_request("Rom.", **long)))
        wait_until(lambda: srv.server.engine.in_flight == 2, what="the second request to be accepted")
        alone.open()
        both.wait_reached_sync()  # both hold a slot: the engine is held decoding the two of them
        queued = c.stub.Generate.future(build_request("Ham.", **long))
        wait_until(lambda: c.server_info().requests_waiting == 1, what="the third request to queue")
        with pytest.raises(grpc.RpcError) as e:
            c.generate("Mac.", **long)
        assert e.value.code() is CODE.RESOURCE_EXHAUSTED
        assert "max_waiting=1" in e.value.details()
        hint = dict(e.value.trailing_metadata())[RETRY_AFTER_KEY]
        assert int(hint) > 0
        both.open()
        for f in [*running, queued]:
            assert len(f.result(60).completions[0].token_ids) == 40
        wait_until(lambda: all_free(c), what="every slot to come back")


def test_deadline_in_the_queue(engine_bundle):
    s = settings(engine_bundle, max_running=1, max_batch_tokens=64, warmup=False)
    gates = []
    engine = engine_for(s, lambda e: gates.append(Gate(e, at=1)))
    with ServerThread(s, engine) as srv, Client(srv.address, timeout_s=60) as c:
        holder = c.stub.Generate.future(build_request("Rom.", max_new_tokens=20, ignore_eos=True))
        gates[0].wait_reached_sync()
        with pytest.raises(grpc.RpcError) as e:
            c.generate("Ham.", max_new_tokens=5, timeout_s=0.3)
        assert e.value.code() is CODE.DEADLINE_EXCEEDED
        assert c.server_info().requests_waiting <= 1
        gates[0].open()
        assert len(holder.result(60).completions[0].token_ids) == 20
        wait_until(lambda: all_free(c), what="every slot to come back")
        assert not srv.server.engine.engine.requests


def test_deadline_while_running_frees_the_slot(engine_bundle):
    s = settings(engine_bundle, warmup=False)
    with ServerThread(s, engine_for(s, slowed(0.02))) as srv, Client(srv.address, timeout_s=60) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("Rom.", max_new_tokens=100, ignore_eos=True, timeout_s=0.4)
        assert e.value.code() is CODE.DEADLINE_EXCEEDED
        wait_until(lambda: all_free(c), what="the slot to come back")
        assert 0 < srv.server.engine.engine.counters.generated_tokens < 100  # stopped part-way
        # the status reaches the client before the server counts it
        expired = srv.server.metrics.requests.labels("grpc", "Generate", "DEADLINE_EXCEEDED")
        wait_until(lambda: expired._value.get() == 1, what="the expired call to be counted")
        with pytest.raises(grpc.RpcError) as e:  # the same for a stream, after its first tokens
            for _ in c.stream_responses("Rom.", max_new_tokens=100, ignore_eos=True, timeout_s=0.4):
                pass
        assert e.value.code() is CODE.DEADLINE_EXCEEDED
        wait_until(lambda: all_free(c), what="the slot to come back")


def test_cancel_mid_stream_frees_the_slot_and_spares_the_others(engine_bundle):
    s = settings(engine_bundle, warmup=False)
    with ServerThread(s, engine_for(s, slowed(0.005))) as srv, Client(srv.address, timeout_s=60) as c:
        survivor = c.stub.Generate.future(build_request("Ham.", max_new_tokens=60, ignore_eos=True, seed=2))
        call = c.stub.GenerateStream(build_request("Rom.", max_new_tokens=120, ignore_eos=True), timeout=60)
        got = [next(call) for _ in range(3)]
        assert all(m.token_ids for m in got)
        assert c.server_info().kv_free_slots < c.server_info().kv_slots
        call.cancel()
        wait_until(lambda: srv.server.metrics.requests.labels("grpc", "GenerateStream", "CANCELLED")._value.get() == 1,
                   what="the cancel to reach the server")
        result = survivor.result(60)
        assert len(result.completions[0].token_ids) == 60
        wait_until(lambda: all_free(c), what="the slot to come back")
        alone = c.generate("Ham.", max_new_tokens=60, ignore_eos=True, seed=2)
        assert result.completions[0].token_ids == alone.completions[0].token_ids


def test_a_model_fault_fails_only_that_step_and_the_server_keeps_serving(engine_bundle):
    s = settings(engine_bundle, warmup=False)
    faults = {"calls": 0}
    lock = threading.Lock()

    def wrap(engine):
        original = engine.runner.decode

        def decode(ids, positions):
            with lock:
                faults["calls"] += 1
                if faults["calls"] == 3:
                    raise RuntimeError("injected fault")
            return original(ids, positions)

        engine.runner.decode = decode

    with ServerThread(s, engine_for(s, wrap)) as srv, Client(srv.address, timeout_s=60) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("Rom.", max_new_tokens=10, ignore_eos=True)
        assert e.value.code() is CODE.INTERNAL and "the model call failed" in e.value.details()
        assert "injected fault" not in e.value.details()  # the exception's text is the log's, not the client's
        assert len(c.generate("Rom.", max_new_tokens=10, ignore_eos=True).completions[0].token_ids) == 10
        wait_until(lambda: all_free(c), what="every slot to come back")
        failed = srv.server.metrics.requests.labels("grpc", "Generate", "INTERNAL")  # counted after the status is sent
        wait_until(lambda: failed._value.get() == 1, what="the failed call to be counted")
