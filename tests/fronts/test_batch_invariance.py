"""Batch invariance end to end: a request gets the same tokens, greedy and seeded, alone on the server and
amid other requests of other lengths, over gRPC and over HTTP, on every graph `--graph auto` may serve.

Each probe prompt is first generated alone. Then other streams are started, and once every one of them is
generating, the probes are sent again, all at once, so they are prefilled together and decoded in a full
batch. The server's decode steps are slowed a little so that the other streams are still running when the
probes finish; the test checks that they were, and repeats the round (up to 3 times) if a loaded machine
delayed a client so long that they were not.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test tool of the HTTP front")

from service.client import Client  # noqa: E402
from service.client.grpc_client import build_request  # noqa: E402
from service.runtime.bundle import read_manifest  # noqa: E402
from tests.fronts.server_harness import ServerThread, engine_for, free_port, settings, slowed, wait_until  # noqa: E402

SERVED_GRAPHS = ("static", "static-int8", "static-int4")
NEW_TOKENS = 16
PROBE_LENGTHS = (3, 17, 9, 30)  # 17: a prompt of 16k + 1 tokens, which onnxruntime's attention tiles unevenly
LOAD_STREAMS = 10
SAMPLED = dict(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module", params=SERVED_GRAPHS)
def served(request, engine_bundle):
    """A server on one graph: gRPC and HTTP. allow_low_agreement: the test bundle's model is drawn to make
    varied text, not to quantize well (its INT8 graph agrees with fp32 on 89% of the probe)."""
    if request.param not in read_manifest(engine_bundle).graphs:
        pytest.skip(f"the engine bundle has no {request.param!r} graph")
    s = settings(engine_bundle, graph=request.param, allow_low_agreement=True, http_port=free_port(),
                 max_running=LOAD_STREAMS + len(PROBE_LENGTHS), max_batch_tokens=512)
    with ServerThread(s, engine=engine_for(s, slowed(0.004))) as srv:
        yield srv


@pytest.fixture(scope="module")
def prompts(engine_bundle) -> tuple[list[list[int]], list[list[int]]]:
    """(probe prompts, load prompts) of token ids; the load's are of other lengths."""
    vocab = min(read_manifest(engine_bundle).model.vocab_size, 300)
    rng = np.random.default_rng(5)
    probes = [rng.integers(1, vocab, n).tolist() for n in PROBE_LENGTHS]
    load = [rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(1, 40, LOAD_STREAMS)]
    return probes, load


def probe_requests(probes: list[list[int]]) -> list[dict]:
    """Each probe greedy and seeded-sampled: exactly NEW_TOKENS each."""
    return [dict(prompt=p, max_new_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
            for p in probes for sampling in (dict(temperature=0.0), dict(SAMPLED, seed=100 + len(p)))]


class Load:
    """Streams generating until the context is full or they are closed; `running` until each has ended."""

    def __init__(self, address: str, prompts: list[list[int]], context: int):
        self.client = Client(address, timeout_s=120)
        self.started = [threading.Event() for _ in prompts]
        self.ended = [threading.Event() for _ in prompts]
        self.calls = [self.client.stub.GenerateStream(build_request(p, max_new_tokens=context - len(p) - 1,
                                                                    ignore_eos=True, temperature=1.0, seed=i))
                      for i, p in enumerate(prompts)]
        self.threads = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in self.threads:
            t.start()

    def _read(self, i: int) -> None:
        try:
            for _ in self.calls[i]:
                self.started[i].set()
        except grpc.RpcError:
            pass  # cancelled by the test
        finally:
            self.started[i].set()
            self.ended[i].set()

    def all_started(self) -> bool:
        return all(e.is_set() for e in self.started)

    @property
    def running(self) -> bool:
        return not any(e.is_set() for e in self.ended)

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for t in self.threads:
            t.join(30)
        self.client.close()


def amid_load(srv: ServerThread, load_prompts: list[list[int]], send) -> list:
    """`send()` while the load streams run; repeated (up to 3 rounds) until the load outlasted it."""
    context = read_manifest(srv.settings.bundle[0]).model.n_ctx
    for _ in range(3):
        load = Load(srv.address, load_prompts, context)
        try:
            wait_until(load.all_started, timeout=60, what="every load stream to start")
            assert load.running, "a load stream ended before the probes were sent"
            out = send()
            if load.running:
                return out
        finally:
            load.close()
    pytest.fail("in 3 rounds the load streams never outlasted the probes")


def test_grpc_tokens_alone_equal_tokens_amid_load(served, prompts):
    probes, load = prompts
    requests = probe_requests(probes)
    with Client(served.address, timeout_s=120) as client:
        def tokens(r: dict) -> list[int]:
            return list(client.generate(**r).completions[0].token_ids)

        alone = [tokens(r) for r in requests]
        assert all(len(t) == NEW_TOKENS for t in alone)
        with ThreadPoolExecutor(len(requests)) as pool:
            together = amid_load(served, load, lambda: list(pool.map(tokens, requests)))
    assert together == alone
    assert len({tuple(t) for t in alone}) > len(probes)  # the probes are not one repeated answer


def test_http_text_alone_equals_text_amid_load(served, prompts):
    probes, load = prompts
    with openai.OpenAI(base_url=served.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as api:
        def text(r: dict) -> str:
            extra = {"ignore_eos": True}
            sampling = {k: r[k] for k in ("temperature", "top_p", "seed") if k in r}
            return api.completions.create(model="", prompt=r["prompt"], max_tokens=r["max_new_tokens"],
                                          extra_body=extra, **sampling).choices[0].text

        requests = probe_requests(probes)
        alone = [text(r) for r in requests]
        with ThreadPoolExecutor(len(requests)) as pool:
            together = amid_load(served, load, lambda: list(pool.map(text, requests)))
    assert together == alone
