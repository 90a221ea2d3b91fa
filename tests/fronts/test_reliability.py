"""What the server survives under load: 4x overload, a storm of cancellations, deadlines expiring
in the queue and while running, and a client that reads slowly. Every case ends by checking that
all KV slots and queue places came back, and that the requests that should complete did, with the
same tokens as when run alone."""

from __future__ import annotations

import asyncio
import random
import threading

import grpc
import pytest

from service.client import AsyncClient, Client, build_request
from tests.fronts.server_harness import ServerThread, engine_for, settings, slowed, wait_until

pytestmark = pytest.mark.slow


def all_free(c: Client) -> bool:
    info = c.server_info()
    return info.requests_running == 0 and info.requests_waiting == 0 and info.kv_free_slots == info.kv_slots


def alone(c: Client, prompt: str, **fields) -> list[int]:
    return list(c.generate(prompt, **fields).completions[0].token_ids)


def test_four_times_overload_is_refused_fast_and_the_accepted_complete(engine_bundle):
    s = settings(engine_bundle, max_running=4, max_waiting=8, max_batch_tokens=64, warmup=False)
    capacity = s.max_running + s.max_waiting
    offered = 4 * capacity
    fields = dict(max_new_tokens=24, ignore_eos=True, temperature=0.0)

    async def one(c: AsyncClient, i: int):
        try:
            tokens = []
            async for msg in c.stream_responses(f"Rom. {i}", **fields):
                tokens += msg.token_ids
            return "OK", tokens
        except grpc.aio.AioRpcError as e:
            return e.code().name, dict(e.trailing_metadata() or ())

    async def storm(address):
        async with AsyncClient(address, timeout_s=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(offered)))

    with ServerThread(s, engine_for(s, slowed(0.01))) as srv, Client(srv.address, timeout_s=60) as c:
        results = asyncio.run(storm(srv.address))
        codes = [code for code, _ in results]
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes  # nothing hung into a deadline
        # admission estimates the queue from the engine's last published step, erring towards refusing by at most
        # the requests one step starts (AsyncEngine._admit): capacity, give or take max_running
        assert codes.count("OK") >= capacity - s.max_running
        assert codes.count("RESOURCE_EXHAUSTED") >= offered - capacity - s.max_running
        assert all("retry-after-ms" in meta for code, meta in results if code == "RESOURCE_EXHAUSTED")
        for i, (code, tokens) in enumerate(results):
            if code == "OK":
                assert tokens == alone(c, f"Rom. {i}", **fields)
        wait_until(lambda: all_free(c), what="every slot and queue place to come back")


def test_a_storm_of_100_cancels_returns_every_slot_and_spares_the_survivors(engine_bundle):
    s = settings(engine_bundle, max_running=16, max_waiting=128, max_batch_tokens=128, warmup=False)
    rng = random.Random(7)
    stops = [rng.randint(0, 6) for _ in range(100)]  # cancel after this many messages (0 = before any)
    survivors = {f"Ham. {i}": dict(max_new_tokens=40, ignore_eos=True, seed=i, temperature=0.9) for i in range(4)}

    async def cancelled(c: AsyncClient, i: int) -> int:
        call = c.stub.GenerateStream(build_request(f"Rom. {i}", max_new_tokens=100, ignore_eos=True),
                                     timeout=120, metadata=c.metadata)
        seen = 0
        async for _ in call:
            if seen >= stops[i]:
                break
            seen += 1
        call.cancel()
        return seen

    async def survive(c: AsyncClient, prompt: str) -> list[int]:
        return list((await c.generate(prompt, **survivors[prompt])).completions[0].token_ids)

    async def run(address):
        async with AsyncClient(address, timeout_s=120) as c:
            kept = asyncio.gather(*(survive(c, p) for p in survivors))
            await asyncio.gather(*(cancelled(c, i) for i in range(100)))
            return await kept

    with ServerThread(s, engine_for(s, slowed(0.002))) as srv, Client(srv.address, timeout_s=60) as c:
        results = asyncio.run(run(srv.address))
        wait_until(lambda: all_free(c), timeout=30, what="all 100 cancelled requests' slots")
        # a cancelled call is counted when its handler unwinds, which the freed slot does not wait for
        cancels = srv.server.metrics.requests.labels("grpc", "GenerateStream", "CANCELLED")
        wait_until(lambda: cancels._value.get() == 100, timeout=30, what="all 100 cancels to be counted")
        for prompt, tokens in zip(survivors, results, strict=True):
            assert len(tokens) == 40 and tokens == alone(c, prompt, **survivors[prompt])


def test_deadlines_in_the_queue_and_while_running_under_load(engine_bundle):
    s = settings(engine_bundle, max_running=2, max_waiting=32, warmup=False)
    deadlines = [0.05, 0.1, 0.2, 0.4, 0.8, 5.0, 5.0, 60.0] * 2

    async def one(c: AsyncClient, i: int, deadline: float) -> str:
        try:
            await c.generate(f"Mac. {i}", max_new_tokens=30, ignore_eos=True, timeout_s=deadline)
            return "OK"
        except grpc.aio.AioRpcError as e:
            return e.code().name

    async def run(address):
        async with AsyncClient(address) as c:
            return await asyncio.gather(*(one(c, i, d) for i, d in enumerate(deadlines)))

    with ServerThread(s, engine_for(s, slowed(0.01))) as srv, Client(srv.address, timeout_s=60) as c:
        codes = asyncio.run(run(srv.address))
        assert set(codes) == {"OK", "DEADLINE_EXCEEDED"}, codes
        assert codes[deadlines.index(60.0)] == "OK" and codes[0] == "DEADLINE_EXCEEDED"
        wait_until(lambda: all_free(c), what="the expired requests' slots")


def test_a_slow_reader_does_not_stall_the_others_and_its_buffer_is_bounded(engine_bundle):
    """The engine never waits for a consumer: a request's undelivered tokens wait in its own
    stream, which holds at most n x max_new_tokens events, and gRPC's flow control holds the rest.
    The slow client reads one message, then nothing until another client's whole stream is done."""
    s = settings(engine_bundle, warmup=False)
    fields = dict(max_new_tokens=100, ignore_eos=True, temperature=0.0)
    fast_done = threading.Event()

    with ServerThread(s, engine_for(s, slowed(0.002))) as srv, Client(srv.address, timeout_s=60) as c:
        slow = c.stream_responses("Rom.", **fields)
        first = next(slow)
        [slow_stream] = srv.server.engine._streams.values()  # held here: the engine forgets it once it ends
        fast = alone(c, "Ham.", **fields)  # completes while the slow reader reads nothing
        fast_done.set()
        assert len(fast) == 100
        wait_until(lambda: slow_stream.ended, what="the engine to finish the slow request, unread")
        assert len(slow_stream._items) <= slow_stream.n * fields["max_new_tokens"]
        rest = list(slow)
        tokens = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert tokens == alone(c, "Rom.", **fields)
        assert len(rest) + 1 < 100  # what piled up came merged, not as a backlog of one-token messages
        wait_until(lambda: all_free(c), what="the slot to come back")
