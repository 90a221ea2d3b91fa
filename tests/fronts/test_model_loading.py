"""Models loaded when called and unloaded when idle or when the budget needs room, with no request failing for
it: a model listed but not loaded loads on its first request (which waits; calls to other models go on), the
least recently used idle model makes room for another, `keep_alive_s` unloads an idle one, and the admin calls
load and unload by hand behind the server's token."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2  # the HTTP client the openai client brings
import pytest

from service.client import Client, build_request
from service.engine.cache_plan import MARGIN_BYTES
from service.runtime.memory import resident_bytes
from tests.fronts.conftest import GREEDY, PROMPT
from tests.fronts.server_harness import ServerThread, free_port, settings, slowed

TOKEN = "admin-secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
KV_BYTES = 512 * 2**20  # each model's KV cache: reserved address space, taken only as tokens are written


def states(h: httpx2.Client) -> dict[str, str]:
    return h.get("/health").json()["models"]


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.01)


def complete(h: httpx2.Client, name: str) -> str:
    r = h.post("/v1/completions", json={"model": name, "prompt": PROMPT, **GREEDY})
    assert r.status_code == 200 and r.json()["model"] == name, r.text
    return r.json()["choices"][0]["text"]


def test_a_model_loads_on_its_first_request_while_the_others_serve(bundles, alone):
    names = list(bundles)
    s = settings(list(bundles.values()), preload="default", http_port=free_port(), warmup=False)
    with ServerThread(s) as srv, httpx2.Client(base_url=srv.http_url, timeout=60) as h, \
            Client(srv.address, timeout_s=60) as c:
        assert states(h) == {names[0]: "serving", names[1]: "unloaded", names[2]: "unloaded"}
        cards = {m["id"]: m for m in h.get("/v1/models").json()["data"]}
        assert cards[names[1]]["state"] == "unloaded" and cards[names[1]]["max_model_len"] > 0
        listed = {m.name: m for m in c.list_models()}
        assert listed[names[1]].state == "unloaded" and listed[names[1]].graph == "" and listed[names[1]].vocab_size
        gate = threading.Event()
        load = srv.server.loader.load

        async def gated_load(model, kv_bytes, status=lambda _: None):
            await asyncio.to_thread(gate.wait, 60)
            return await load(model, kv_bytes, status)

        srv.server.loader.load = gated_load
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(complete, h, names[1])  # waits for its model to load
            wait_for(lambda: states(h)[names[1]] == "loading", "the model to be loading")
            assert complete(h, names[0]) == alone[names[0]][0]  # the default serves meanwhile, over both fronts
            got = c.generate(PROMPT, model=names[0], temperature=0.0, max_new_tokens=8, ignore_eos=True)
            assert list(got.completions[0].token_ids) == alone[names[0]][1]
            assert states(h)[names[1]] == "loading" and not first.done()
            gate.set()
            assert first.result(60) == alone[names[1]][0]
        assert states(h)[names[1]] == "serving" and states(h)[names[2]] == "unloaded"
        got = c.generate(PROMPT, model=names[2], temperature=0.0, max_new_tokens=8, ignore_eos=True)  # gRPC loads too
        assert list(got.completions[0].token_ids) == alone[names[2]][1]
        assert c.model_info(names[2]).state == "serving" and c.model_info(names[2]).graph == "static"


def test_a_budget_too_small_for_all_three_unloads_the_least_recently_used(bundles, alone):
    """With room for two models, the third's first request unloads the least recently used idle one; every
    request, sequential or concurrent, gets the answer its model gives alone."""
    names = list(bundles)
    budget = resident_bytes() + MARGIN_BYTES + int(2.5 * KV_BYTES)  # two models' KV caches, not three
    s = settings(list(bundles.values()), kv_cache_bytes=KV_BYTES, memory_budget=str(budget), http_port=free_port(),
                 warmup=False)
    with ServerThread(s) as srv, httpx2.Client(base_url=srv.http_url, timeout=60) as h:
        pool = srv.server.pool
        assert states(h) == {names[0]: "serving", names[1]: "serving", names[2]: "unloaded"}
        complete(h, names[1])
        complete(h, names[0])  # names[1] is now the least recently used
        assert complete(h, names[2]) == alone[names[2]][0]
        assert states(h) == {names[0]: "serving", names[1]: "unloaded", names[2]: "serving"}
        assert complete(h, names[1]) == alone[names[1]][0]  # reloaded; names[0] made room
        assert states(h) == {names[0]: "unloaded", names[1]: "serving", names[2]: "serving"}

        def several(name: str) -> list[str]:
            with httpx2.Client(base_url=srv.http_url, timeout=120) as own:
                return [complete(own, name) for _ in range(4)]

        with ThreadPoolExecutor(6) as threads:
            answers = list(threads.map(several, names * 2))
        for name, texts in zip(names * 2, answers, strict=True):
            assert texts == [alone[name][0]] * 4, name
        assert sum(state == "serving" for state in states(h).values()) <= 2
        assert sum(m.footprint for m in pool.models if m.state == "serving") <= budget - pool.held - MARGIN_BYTES


def test_an_idle_model_is_unloaded_after_keep_alive_and_reloaded_when_called(bundles, alone):
    name = next(iter(bundles))
    s = settings(bundles[name], keep_alive_s=0.2, http_port=free_port(), warmup=False)
    with ServerThread(s) as srv, httpx2.Client(base_url=srv.http_url, timeout=60) as h:
        assert complete(h, name) == alone[name][0]
        wait_for(lambda: states(h)[name] == "unloaded", "the idle model to be unloaded")
        assert h.get("/health").status_code == 200  # the server serves: its model loads when called
        assert complete(h, name) == alone[name][0]
        assert srv.server.pool.models[0].loads == 2


def test_the_admin_calls_load_and_unload_behind_the_token(bundles, alone):
    names = list(bundles)
    s = settings(list(bundles.values()), auth_token=TOKEN, http_port=free_port(), warmup=False)
    with ServerThread(s) as srv, httpx2.Client(base_url=srv.http_url, timeout=60) as h, \
            Client(srv.address, timeout_s=60, token=TOKEN) as c:
        assert h.post("/models/unload", json={"model": names[1]}).status_code == 401
        r = h.post("/models/unload", json={"model": names[1]}, headers=AUTH)
        assert r.status_code == 200 and r.json()["id"] == names[1] and r.json()["state"] == "unloaded", r.text
        assert states(h)[names[1]] == "unloaded"
        r = h.post("/models/load", json={"model": names[1]}, headers=AUTH)
        assert r.status_code == 200 and r.json()["state"] == "serving"
        assert c.unload_model(names[2]).state == "unloaded"
        assert {m.name: m.state for m in c.list_models()}[names[2]] == "unloaded"
        assert c.load_model(names[2]).state == "serving"
        assert c.unload_model().name == names[0]  # empty: the default
        r = h.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}, headers=AUTH)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone[names[0]][0]
        r = h.post("/models/load", json={"model": "nope"}, headers=AUTH)
        assert r.status_code == 404 and "serves" in r.json()["error"]["message"]
        r = h.post("/models/load", json={"model": 3}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        with pytest.raises(grpc.RpcError) as e:
            c.load_model("nope")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    open_server = settings(list(bundles.values()), http_port=free_port(), warmup=False)
    with ServerThread(open_server) as srv, httpx2.Client(base_url=srv.http_url, timeout=60) as h, \
            Client(srv.address, timeout_s=60) as c:
        r = h.post("/models/unload", json={"model": names[1]})
        assert r.status_code == 403 and "auth_token" in r.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            c.unload_model(names[1])
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert states(h)[names[1]] == "serving"


def test_unloading_waits_for_the_calls_using_the_model(bundles):
    names = list(bundles)
    s = settings(list(bundles.values())[:2], auth_token=TOKEN, warmup=False)
    with ServerThread(s) as srv, Client(srv.address, timeout_s=60, token=TOKEN) as c:
        model = srv.server.serving.models[names[1]]
        slowed(0.01)(model.engine.engine)
        stream = c.stub.GenerateStream(build_request("Rom.", model=names[1], max_new_tokens=60, ignore_eos=True),
                                       timeout=60, metadata=c.metadata)
        first = next(stream)
        with ThreadPoolExecutor(1) as pool:
            unloading = pool.submit(c.unload_model, names[1])
            wait_for(lambda: model.state == "unloading", "the unload to begin")
            rest = list(stream)  # the stream goes on to its end
            assert sum(len(m.token_ids) for m in [first, *rest]) == 60
            assert unloading.result(60).state == "unloaded"
        got = c.generate("Rom.", model=names[1], max_new_tokens=4, ignore_eos=True)  # loads it again
        assert len(got.completions[0].token_ids) == 4 and model.state == "serving"
