"""What the tests and `attnserve bench replicas` run against several replicas on loopback and the balancers
users put in front of them: a rolling update, a killed replica, and capacity, each under streaming load.

    with Fleet(3, bundle) as fleet, Nginx(fleet) as nginx:
        load = load_on("nginx_grpc", fleet, nginx, clients=32, new_tokens=32)
        steps = asyncio.run(roll_under_load(fleet, load))
        load.summary(fleet.refusals() | nginx.resent())

The parts: `bench/fleet.py` (the replicas), `bench/nginx.py` (nginx in front of them, from deploy/nginx),
`bench/load_clients.py` (the streaming clients and their accounting). Clients reach the fleet by one of
`PATHS`: the Python client's round robin over every replica, gRPC through nginx, or HTTP through nginx.

Retries are the client's: the gRPC clients use the shipped channel options (`channel_options`: the retry
policy, and round robin with health checks when they reach the replicas themselves); over HTTP, nginx's
`proxy_next_upstream`. A request counts as *retried* when a replica refused it (its id in that replica's log
as refused) and then it completed elsewhere, or when nginx sent it to more than one replica (its access log).
A call refused at a closed port or by a GOAWAY is sent again inside the gRPC channel, where no log sees it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from bench.fleet import Fleet, Replica
from bench.load_clients import HttpLoad, Load, StreamLoad
from bench.nginx import MIN_READY_S, Nginx
from bench.peers.protocol import percentile

PATHS = ("round_robin", "nginx_grpc", "nginx_http")  # how clients reach the fleet


def load_on(path: str, fleet: Fleet, nginx: Nginx, **kw) -> Load:
    """Clients over `path`: the Python client's round robin over every replica, or gRPC or HTTP through nginx."""
    if path == "round_robin":
        return StreamLoad(fleet.grpc_target, round_robin=True, **kw)
    if path == "nginx_grpc":
        return StreamLoad(nginx.grpc_address, **kw)
    return HttpLoad(nginx.http_url, **kw)


def method_of(path: str) -> str:
    """The name a replica's metrics count `path`'s calls under."""
    return "/v1/completions" if path == "nginx_http" else "GenerateStream"


async def roll_under_load(fleet: Fleet, load: Load, settle: int = 2, min_ready_s: float = MIN_READY_S) -> list[dict]:
    """The load runs; once `settle` requests per client are done, the fleet is rolled (`min_ready_s` between a
    replica SERVING and the next one's SIGTERM); the load runs on until `settle` more per client are done.
    Requests are labelled "steady", "roll" and "after" by when they were sent."""
    async with load.running():
        await load.wait_for(lambda: load.completed_count() >= settle * load.clients)
        load.phase = "roll"
        steps = await fleet.roll(min_ready_s)
        load.phase = "after"
        done = load.completed_count()
        await load.wait_for(lambda: load.completed_count() >= done + settle * load.clients)
    return steps


async def kill_under_load(load: Load, victim: Replica, settle: int = 1, after: int = 3) -> float:
    """SIGKILL `victim` while it sends tokens on at least two streams; returns when it had exited. Requests sent later
    are "after": a request sent while the signal was on its way may still have reached the victim."""
    async with load.running():
        await load.wait_for(lambda: load.completed_count() >= settle * load.clients)
        await load.wait_for(lambda: victim.streaming() >= 2)
        await asyncio.to_thread(victim.kill)
        killed_at = time.monotonic()
        load.phase = "after"
        done = load.completed_count()
        await load.wait_for(lambda: load.completed_count() >= done + after * load.clients)
    return killed_at


async def capacity(fleet: Fleet, load: StreamLoad, warm: int = 1, measured: int = 4) -> dict:
    """Tokens/s and TTFT over a window of steady load: from when `warm` requests per client are done until
    `measured` more per client are; tokens of the requests that ended in the window, TTFT of those sent in it,
    and each replica's share of the calls that ended in it (from its metrics)."""
    async with load.running():
        await load.wait_for(lambda: load.completed_count() >= warm * load.clients)
        load.phase, start = "measured", time.monotonic()
        done, before = load.completed_count(), fleet.counts("GenerateStream")
        await load.wait_for(lambda: load.completed_count() >= done + measured * load.clients)
        end, shares = time.monotonic(), fleet.shares(before, "GenerateStream")
        load.phase = "tail"
    ended = [o for o in load.outcomes if o.code == "OK" and start <= o.ended <= end]
    ttfts = [o.ttft for o in load.outcomes if o.phase == "measured" and o.ttft is not None]
    return {"tokens_per_s": sum(o.tokens for o in ended) / (end - start), "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99), "requests": len(ended), "shares": shares,
            "errors": dict(Counter(o.code for o in load.outcomes if o.code not in ("OK", "")))}
