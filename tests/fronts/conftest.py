"""The one shared live server: a real attnserve server on the engine bundle, gRPC and HTTP, started once
for the session, and clients of it. Tests that need other settings (limits, TLS, a fault in the engine)
start their own `ServerThread`. For several models in one server: three bundles of three kinds, and what
each answers served alone."""

from __future__ import annotations

import httpx2  # the HTTP client the openai client brings
import pytest

from service.client import Client
from service.runtime.bundle import read_manifest
from tests.fronts.server_harness import ServerThread, free_port, settings

PROMPT = "transformer"  # a word: the encoder-decoder is a grapheme-to-phoneme model
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="session")
def server(engine_bundle):
    with ServerThread(settings(engine_bundle, metrics_port=free_port(), http_port=free_port())) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server):
    with Client(server.address, timeout_s=60) as c:
        yield c


@pytest.fixture(scope="session")
def bundles(engine_bundle, llama_bundle, seq2seq_bundle):
    """Three bundles of three kinds (a decoder, a Llama-family decoder, an encoder-decoder), by model name."""
    named = {read_manifest(b).model.name: b for b in (engine_bundle, llama_bundle, seq2seq_bundle)}
    assert len(named) == 3, named
    return named


@pytest.fixture(scope="session")
def alone(bundles):
    """What each bundle answers served alone: its greedy completion over HTTP and its token ids over gRPC."""
    answers = {}
    for name, bundle in bundles.items():
        with ServerThread(settings(bundle, http_port=free_port(), warmup=False)) as srv, \
                httpx2.Client(base_url=srv.http_url, timeout=60) as h, Client(srv.address, timeout_s=60) as c:
            text = h.post("/v1/completions", json={"prompt": PROMPT, **GREEDY}).json()["choices"][0]["text"]
            ids = list(c.generate(PROMPT, temperature=0.0, max_new_tokens=8, ignore_eos=True).completions[0].token_ids)
            answers[name] = (text, ids)
    return answers
