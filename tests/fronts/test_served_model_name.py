"""`--served-model-name`: the name clients know the model by, on every route and RPC that names it; the
bundle's own name is then unknown to the server, as any other model's is."""

from __future__ import annotations

import json

import httpx2  # the HTTP client the openai client brings
import pytest

from service.client import Client
from service.runtime.bundle import read_manifest
from tests.fronts.server_harness import ServerThread, free_port, settings

SERVED = "poet-7b"


@pytest.fixture(scope="module")
def renamed(engine_bundle):
    with ServerThread(settings(engine_bundle, served_model_name=SERVED, warmup=False, http_port=free_port())) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(renamed):
    with httpx2.Client(base_url=renamed.http_url, timeout=60) as h:
        yield h


def test_the_model_list_and_card_carry_the_served_name(http):
    listed = http.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == [SERVED]
    card = http.get(f"/v1/models/{SERVED}")
    assert card.status_code == 200 and card.json()["id"] == SERVED


def test_responses_whole_and_streamed_carry_the_served_name(http):
    body = {"model": SERVED, "prompt": "Rom.", "max_tokens": 3, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body)
    assert whole.status_code == 200 and whole.json()["model"] == SERVED
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as sse:
        chunks = [json.loads(line[6:]) for line in sse.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {SERVED}


def test_the_bundles_own_name_is_refused_like_any_unknown_model(http, engine_bundle):
    bundle_name = read_manifest(engine_bundle).model.name
    assert bundle_name != SERVED
    refused = http.post("/v1/completions", json={"model": bundle_name, "prompt": "Rom.", "max_tokens": 1})
    assert refused.status_code == 404
    assert refused.json()["error"]["message"] == f"the model {bundle_name!r} does not exist; this server serves {SERVED!r}"
    assert http.get(f"/v1/models/{bundle_name}").status_code == 404


def test_grpc_model_info_carries_the_served_name(renamed):
    with Client(renamed.address, timeout_s=30) as c:
        assert c.model_info().name == SERVED
