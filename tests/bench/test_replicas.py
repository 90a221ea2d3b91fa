"""Three replicas behind the balancers users run (`bench.replicas`, `bench.fleet`, `bench.nginx`): gRPC's client-side round robin with the
shipped channel options, and nginx with deploy/nginx/attnserve.conf.template for gRPC and for the HTTP API.
Calls are balanced per request; a rolling update loses no request; a replica that dies fails only the streams
it was sending, with UNAVAILABLE, and every request sent after it died completes on the others."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx2
import pytest
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub

from bench.fleet import Fleet
from bench.nginx import Nginx, nginx_binary, render_template
from bench.replicas import PATHS, kill_under_load, load_on, method_of, roll_under_load
from service.client.grpc_client import SERVICE_NAME, Client
from tests.conftest import SHIPPED_BUNDLE

pytestmark = pytest.mark.slow

CLIENTS = 32
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    try:
        nginx_binary()
    except RuntimeError as e:  # CI must run these; elsewhere, say why they did not
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no nginx: {e}")
    with Fleet(3, SHIPPED_BUNDLE, ["--threads", "1", "--grace-period-s", "60"],
               workdir=tmp_path_factory.mktemp("fleet")) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def nginx(fleet):
    with Nginx(fleet) as nginx:
        yield nginx


def test_the_template_renders_as_envsubst_would():
    text = "listen ${ATTNSERVE_GRPC_LISTEN} http2; proxy_set_header Host $host;"
    assert render_template(text, {"ATTNSERVE_GRPC_LISTEN": "9000"}) == "listen 9000 http2; proxy_set_header Host $host;"
    with pytest.raises(KeyError, match="ATTNSERVE_GRPC_LISTEN"):
        render_template(text, {})


@pytest.mark.parametrize("path", PATHS)
def test_calls_are_balanced_per_request(fleet, nginx, path):
    async def run():
        load = load_on(path, fleet, nginx, clients=CLIENTS, new_tokens=NEW_TOKENS, prefix=f"balance-{path}")
        async with load.running():
            await load.wait_for(lambda: load.completed_count() >= 2 * CLIENTS)  # every channel has met every replica
            before = fleet.counts(method_of(path))
            # each client's round robin is exact over its own calls, give or take the one it is in: 60 calls a
            # client bound that to a sixtieth of the calls (5% of a third), inside the 10% asked
            await load.wait_for(lambda: load.completed_count() >= 62 * CLIENTS)
        return load, fleet.shares(before, method_of(path))

    load, shares = asyncio.run(run())
    print(json.dumps({"path": path, "shares": shares}))
    assert load.summary().lost == 0, load.summary()
    for share in shares.values():  # each replica's own count of the calls it finished
        assert abs(share - 1 / 3) <= 0.1 / 3, shares


def test_health_is_not_serving_from_the_start_of_the_drain(fleet):
    """SIGTERM with a long stream in flight: a health watch hears NOT_SERVING at once, a new health check is not
    SERVING (the port takes no new calls), and the stream still ends with every token."""
    replica = fleet.replicas[0]
    with Client(replica.address) as client:
        watch = HealthStub(client.channel).Watch(HealthCheckRequest(service=SERVICE_NAME), timeout=60)
        assert next(watch).status == HealthCheckResponse.SERVING
        stream = client.stream_responses([5, 6, 7], max_new_tokens=240, ignore_eos=True, temperature=0.0)
        tokens = len(next(stream).token_ids)
        replica.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == HealthCheckResponse.NOT_SERVING
        assert replica.health() != "SERVING"
        tokens += sum(len(msg.token_ids) for msg in stream)
    assert tokens == 240
    assert replica.wait(60) == 0
    replica.start()


@pytest.mark.parametrize("path", PATHS)
def test_a_rolling_update_loses_no_request(fleet, nginx, path):
    load = load_on(path, fleet, nginx, clients=CLIENTS, new_tokens=NEW_TOKENS, prefix=f"roll-{path}")
    steps = asyncio.run(roll_under_load(fleet, load))
    summary = load.summary(fleet.refusals() | nginx.resent())
    print(json.dumps({"path": path, **summary.to_dict(), "steps": steps}))
    failed = [(o.request_id, o.code, o.phase, o.tokens, round(o.ended - o.sent, 3)) for o in load.outcomes if o.code != "OK"]
    assert summary.failed == {} and summary.short == 0, (summary, failed[:10])
    assert summary.lost == 0, summary
    assert sum(1 for o in load.outcomes if o.phase == "roll" and o.code == "OK") >= CLIENTS  # it ran during the roll


@pytest.mark.parametrize(("path", "errors"), [("round_robin", {"UNAVAILABLE"}), ("nginx_grpc", {"INTERNAL", "UNAVAILABLE"})])
def test_a_killed_replica_fails_only_its_own_requests(fleet, nginx, path, errors):
    """SIGKILL, no drain: the requests it held end with an error at once, none hangs to its deadline, and every
    request sent after it died completes on the other two.

    Round robin: its streams end UNAVAILABLE as the channel loses the connection; a request it had not answered
    yet is sent again by the retry policy, so only streams that had tokens fail. Through nginx, a stream it was
    sending ends INTERNAL (nginx resets the client's stream when its upstream dies with the response half sent),
    and a request it had not answered may end UNAVAILABLE (nginx's 502)."""
    victim = fleet.replicas[1]
    load = load_on(path, fleet, nginx, clients=CLIENTS, new_tokens=64, prefix=f"kill-{path}", deadline_s=60.0)
    try:
        killed_at = asyncio.run(kill_under_load(load, victim))
    finally:
        victim.start()
    failed = [o for o in load.outcomes if o.code != "OK"]
    print(json.dumps({"path": path, **load.summary().to_dict()}))
    assert failed, "no request was on the killed replica"
    assert {o.code for o in failed} <= errors, [(o.request_id, o.code) for o in failed]
    assert all(o.sent < killed_at for o in failed)
    if path == "round_robin":
        assert all(o.first_token is not None for o in failed)
    after = [o for o in load.outcomes if o.sent > killed_at]
    assert after and all(o.code == "OK" and o.tokens == 64 for o in after)


def test_nginx_passes_server_sent_events_through_unbuffered(nginx):
    """A buffering proxy holds a stream's events until its buffer (4 KiB and up) fills or the response ends: this
    stream's events (under 4 KiB in all) would then reach the client in one read."""
    body = {"prompt": [3, 4, 5], "max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx2.Client(base_url=nginx.http_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks = list(r.iter_raw())
    text = b"".join(chunks)
    assert len(text) < 4096 and b'"completion_tokens":64' in text and text.endswith(b"data: [DONE]\n\n")
    reads = [c.count(b"data: ") for c in chunks if b"data: " in c]
    assert len(reads) >= 3 and reads[0] <= 2, reads
