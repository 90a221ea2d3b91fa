"""Several models in one server: each bundle its own engine, a request's model name picks it (HTTP `model`,
gRPC `model`), none picks the first; each answers as a server of that bundle alone does. A bundle that fails
to load leaves the others serving; names must differ; `models_dir` serves every bundle in a folder."""

from __future__ import annotations

import shutil

import grpc
import httpx2  # the HTTP client the openai client brings
import pytest

from service.client import Client, build_request
from service.engine.cache_plan import MARGIN_BYTES, activation_bytes, sequence_bytes
from service.engine.step_turns import StepTurns
from service.runtime.bundle import read_manifest
from service.runtime.memory import budget_bytes, memory_limit
from service.settings import ServerSettings, SettingsError, load_settings
from tests.fronts.conftest import GREEDY, PROMPT
from tests.fronts.server_harness import ServerThread, free_port, settings, slowed


@pytest.fixture(scope="module")
def several(bundles):
    with ServerThread(settings(list(bundles.values()), http_port=free_port(), warmup=False)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(several):
    with httpx2.Client(base_url=several.http_url, timeout=60) as h:
        yield h


def test_each_model_answers_as_it_does_alone(several, http, alone):
    with Client(several.address, timeout_s=60) as c:
        for name, (text, ids) in alone.items():
            r = http.post("/v1/completions", json={"model": name, "prompt": PROMPT, **GREEDY})
            assert r.status_code == 200 and r.json()["model"] == name, r.text
            assert r.json()["choices"][0]["text"] == text, name
            got = c.generate(PROMPT, model=name, temperature=0.0, max_new_tokens=8, ignore_eos=True)
            assert list(got.completions[0].token_ids) == ids, name
            assert c.model_info(name).name == name
            assert c.tokenize(PROMPT, model=name).token_ids
            assert http.post("/tokenize", json={"model": name, "prompt": PROMPT}).json()["max_model_len"] == \
                c.model_info(name).context_tokens


def test_a_request_that_names_no_model_gets_the_first(several, http, alone, bundles):
    default = next(iter(bundles))
    text, ids = alone[default]
    r = http.post("/v1/completions", json={"prompt": PROMPT, **GREEDY})
    assert r.json()["model"] == default and r.json()["choices"][0]["text"] == text
    with Client(several.address, timeout_s=60) as c:
        assert list(c.generate(PROMPT, temperature=0.0, max_new_tokens=8, ignore_eos=True).completions[0].token_ids) \
            == ids
        assert c.model_info().name == default


def test_an_unknown_model_is_not_found_naming_those_served(several, http, bundles):
    served = ", ".join(map(repr, bundles))
    message = f"the model 'nope' does not exist; this server serves {served}"
    r = http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT})
    assert r.status_code == 404 and r.json()["error"]["message"] == message and r.json()["error"]["param"] == "model"
    assert http.post("/v1/chat/completions", json={"model": "nope", "messages": []}).status_code == 404
    assert http.get("/v1/models/nope").status_code == 404
    with Client(several.address, timeout_s=60) as c:
        for call in (lambda: c.generate(PROMPT, model="nope"), lambda: c.model_info("nope"),
                     lambda: c.tokenize(PROMPT, model="nope")):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details() == message


def test_the_model_list_has_every_model_and_health_each_state(several, http, bundles):
    listed = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == list(bundles)
    for name, bundle in bundles.items():
        card = http.get(f"/v1/models/{name}").json()
        assert card["id"] == name and card["max_model_len"] == read_manifest(bundle).model.n_ctx
    health = http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "serving",
                                                           "models": dict.fromkeys(bundles, "serving")}


def test_the_models_share_the_memory_budget(several):
    """Each engine's KV cache is the one the pool planned for it: no more than its running sequences can fill,
    and what every model takes (weights, largest step, KV cache) stays within the budget together."""
    pool = several.server.pool
    models = list(several.server.serving.models.values())
    s = several.settings
    for model in models:
        engine = model.engine.engine
        assert engine.memory.kv == pool.kv_bytes[model.name] > 0
        per_sequence = sequence_bytes(s.engine_config(model.bundle), engine.model)
        assert engine.kv.n_blocks * engine.kv.block_bytes <= engine.max_running * per_sequence
        assert model.footprint >= engine.memory.kv + activation_bytes(engine.model, engine.context, s.engine_config())
    assert pool.held + MARGIN_BYTES + sum(m.footprint for m in models) <= budget_bytes(s.memory_budget, memory_limit())


def test_a_broken_bundle_leaves_the_others_serving(engine_bundle, llama_bundle, tmp_path):
    corrupt = shutil.copytree(engine_bundle, tmp_path / "corrupt")
    (corrupt / "bundle.json").write_text("{ not json")
    no_graph = shutil.copytree(llama_bundle, tmp_path / "no-graph")
    for graph in no_graph.glob("*.onnx"):
        graph.unlink()
    names = ["good", "corrupt", "no-graph"]
    s = settings([engine_bundle, corrupt, no_graph], served_model_name=names, http_port=free_port(), warmup=False)
    with ServerThread(s) as srv, httpx2.Client(base_url=srv.http_url, timeout=60) as h, \
            Client(srv.address, timeout_s=60) as c:
        assert h.post("/v1/completions", json={"model": "good", "prompt": PROMPT, **GREEDY}).status_code == 200
        health = h.get("/health")
        assert health.status_code == 200
        assert health.json()["models"] == {"good": "serving", "corrupt": "failed", "no-graph": "failed"}
        for name in ("corrupt", "no-graph"):
            r = h.post("/v1/completions", json={"model": name, "prompt": PROMPT})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"].startswith(f"the model {name!r} failed to load: ")
            with pytest.raises(grpc.RpcError) as e:
                c.generate(PROMPT, model=name)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "failed to load" in e.value.details()
        assert "is not valid JSON" in h.post("/v1/completions", json={"model": "corrupt", "prompt": PROMPT}).text
        assert [m["id"] for m in h.get("/v1/models").json()["data"]] == names


def test_every_bundle_broken_fails_the_start_up(engine_bundle, tmp_path):
    broken = [shutil.copytree(engine_bundle, tmp_path / name) for name in ("a", "b")]
    for bundle in broken:
        (bundle / "bundle.json").write_text("[]")
    srv = ServerThread(settings(broken, warmup=False), start=False)
    try:
        with pytest.raises(RuntimeError, match="no model could be loaded: a: .*; b: "):
            srv.call(srv.server.start(), 60)
    finally:
        srv.close()


def test_two_bundles_of_one_name_are_refused_at_start_up(engine_bundle):
    srv = ServerThread(settings([engine_bundle, engine_bundle], warmup=False), start=False)
    try:
        name = read_manifest(engine_bundle).model.name
        with pytest.raises(ValueError, match=f"two bundles are served as the model '{name}'"):
            srv.call(srv.server.start(), 60)
    finally:
        srv.close()


def test_served_names_come_one_per_bundle(engine_bundle, llama_bundle):
    with pytest.raises(SettingsError, match=r"served_model_name: 1 name\(s\) for 2 bundles"):
        load_settings({"bundle": [engine_bundle, llama_bundle], "served_model_name": "one"})
    s = load_settings({"bundle": [engine_bundle, llama_bundle], "served_model_name": ["a", "b"]})
    assert s.served_model_name == ["a", "b"] and s.engine_config().bundle == engine_bundle
    assert s.engine_config(llama_bundle).bundle == llama_bundle


def test_the_models_dir_serves_every_bundle_in_it(engine_bundle, llama_bundle, tmp_path):
    shutil.copytree(llama_bundle, tmp_path / "a-llama")
    shutil.copytree(engine_bundle, tmp_path / "b-engine")
    (tmp_path / "notes").mkdir()  # not a bundle: left out
    values = settings(engine_bundle, warmup=False, http_port=free_port()).model_dump(exclude={"bundle", "models_dir"})
    s = ServerSettings(**values, models_dir=tmp_path)
    assert s.bundle == [tmp_path / "a-llama", tmp_path / "b-engine"]
    with ServerThread(s) as srv, httpx2.Client(base_url=srv.http_url, timeout=60) as h:
        names = [read_manifest(b).model.name for b in s.bundle]
        assert [m["id"] for m in h.get("/v1/models").json()["data"]] == names
        for name in names:
            r = h.post("/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == name
    with pytest.raises(SettingsError, match="holds no bundle"):
        load_settings({"models_dir": tmp_path / "notes"})


def test_per_request_metrics_carry_the_model(several, http, bundles):
    name = list(bundles)[1]
    http.post("/v1/completions", json={"model": name, "prompt": PROMPT, **GREEDY})
    families = {f.name: f for f in several.server.metrics.registry.collect()}
    generated = {s.labels.get("model"): s.value for s in families["attnserve_generated_tokens"].samples
                 if s.name == "attnserve_generated_tokens_total"}
    assert generated.get(name, 0) >= 8 and set(generated) <= set(bundles)


def test_the_drain_ends_every_models_requests(engine_bundle, llama_bundle):
    s = settings([engine_bundle, llama_bundle], warmup=False)
    with ServerThread(s) as srv, Client(srv.address, timeout_s=60) as c:
        calls = []
        for name, model in srv.server.serving.models.items():
            slowed(0.02)(model.engine.engine)  # still running when the grace period ends
            calls.append(c.stub.GenerateStream(build_request("Rom.", model=name, max_new_tokens=100,
                                                             ignore_eos=True), timeout=60))
        for call in calls:
            next(call)
        srv.drain(grace_s=0.1).result(30)
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "grace period" in e.value.details()
        for model in srv.server.serving.models.values():
            assert not model.engine.engine.requests


def test_the_engines_take_turns_at_the_cores_unless_told_not_to(several, engine_bundle, llama_bundle):
    turns = {id(m.engine._turns) for m in several.server.serving.models.values()}
    assert len(turns) == 1 and several.server.loader.turns is not None  # one StepTurns, every engine's
    with ServerThread(settings([engine_bundle, llama_bundle], step_turns=False, warmup=False)) as srv:
        assert srv.server.loader.turns is None
        assert not any(isinstance(m.engine._turns, StepTurns) for m in srv.server.serving.models.values())
