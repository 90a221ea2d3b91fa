"""Speculative decoding seen from outside: each call's usage carries its draft tokens (gRPC `Usage.draft_tokens`
and `accepted_draft_tokens`; HTTP `usage.completion_tokens_details.accepted_prediction_tokens` and
`rejected_prediction_tokens`), whole and streamed, and /metrics counts the drafts of every call.

The server speculates whenever a row has drafts (`eager_speculation`), always the most it may: a greedy request's
drafts are then the same whichever call carries it, so every path must report the same counts."""

from __future__ import annotations

import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test tool of the HTTP front")

from service.client import Client  # noqa: E402
from tests.engine.harness import eager_speculation  # noqa: E402
from tests.fronts.server_harness import (  # noqa: E402
    ServerThread,
    engine_for,
    free_port,
    settings,
    wait_until,
    with_chat_template,
)

PROMPT = "to be or not to be, to be or not to be, to be or not"
CONTENT_ONLY = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # the chat prompt is PROMPT
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def spec_server(engine_bundle, tmp_path_factory):
    bundle = with_chat_template(engine_bundle, tmp_path_factory.mktemp("speculative"), CONTENT_ONLY)
    s = settings(bundle, http_port=free_port(), metrics_port=free_port(), speculative="ngram", speculative_tokens=4)
    with ServerThread(s, engine_for(s, eager_speculation)) as srv:
        yield srv


def spec_counters(srv: ServerThread) -> dict[str, float]:
    """The speculative decoding counters on /metrics, by name."""
    url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {line.split()[0]: float(line.split()[-1]) for line in body.splitlines()
            if line.startswith("attnserve_spec_decode_") and "_total " in line}


def test_every_path_reports_a_calls_draft_counts_and_the_metrics_count_them_all(spec_server):
    before = spec_counters(spec_server)
    assert set(before) == {"attnserve_spec_decode_drafts_total", "attnserve_spec_decode_draft_tokens_total",
                           "attnserve_spec_decode_accepted_tokens_total"}
    grpc_fields = dict(max_new_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with Client(spec_server.address, timeout_s=60) as grpc:
        whole = grpc.generate(PROMPT, **grpc_fields).usage
        streamed = [m for m in grpc.stream_responses(PROMPT, **grpc_fields) if m.HasField("usage")]
    counts = (whole.draft_tokens, whole.accepted_draft_tokens)
    assert counts[0] >= counts[1] > 0, "no draft of this prompt was kept: choose one the model repeats"
    assert len(streamed) == 1 and (streamed[0].usage.draft_tokens, streamed[0].usage.accepted_draft_tokens) == counts

    def http_counts(usage, n: int = 1) -> tuple[int, int]:
        details = usage.completion_tokens_details
        accepted, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
        assert usage.completion_tokens == n * MAX_TOKENS
        return (accepted + rejected) // n, accepted // n

    with openai.OpenAI(base_url=spec_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as api:
        completion = api.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS, **GREEDY)
        two = api.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS, n=2, **GREEDY)
        completion_chunks = list(api.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                                                        stream_options={"include_usage": True}, **GREEDY))
        messages = [{"role": "user", "content": PROMPT}]
        chat = api.chat.completions.create(model="", messages=messages, max_tokens=MAX_TOKENS, **GREEDY)
        chat_chunks = list(api.chat.completions.create(model="", messages=messages, max_tokens=MAX_TOKENS, stream=True,
                                                       stream_options={"include_usage": True}, **GREEDY))
    assert http_counts(completion.usage) == http_counts(two.usage, n=2) == counts
    assert http_counts(completion_chunks[-1].usage) == counts
    assert http_counts(chat.usage) == http_counts(chat_chunks[-1].usage) == counts

    calls = 8  # two sequences in `two`
    expected = {"attnserve_spec_decode_draft_tokens_total": before["attnserve_spec_decode_draft_tokens_total"]
                + calls * counts[0],
                "attnserve_spec_decode_accepted_tokens_total": before["attnserve_spec_decode_accepted_tokens_total"]
                + calls * counts[1]}

    def counted() -> bool:
        now = spec_counters(spec_server)
        return all(now[name] == value for name, value in expected.items())
    wait_until(counted, what="the metrics to count every call's drafts")
    assert spec_counters(spec_server)["attnserve_spec_decode_drafts_total"] > before[
        "attnserve_spec_decode_drafts_total"]
