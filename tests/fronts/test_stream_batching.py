"""How a stream groups tokens into messages: `RequestStream.next_batch` with counts and ages (driven
with chosen event times, so nothing depends on the clock), and the server's stream settings."""

from __future__ import annotations

import asyncio
import time

import pytest

from service.engine.async_engine import RequestStream
from service.engine.errors import ModelError
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from service.engine.sequence import Timing
from tests.fronts.server_harness import ServerThread, engine_for, settings, slowed


def event(i: int, at: float, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent("r", 0, i, 0.0, None, str(i), finish, at)


async def pending(coro):
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.01)
    return task


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


TIMING = Timing(0.0)


def new_stream() -> RequestStream:
    """A stream with no engine behind it: the test puts its events in."""
    return RequestStream(GenerationRequest("r", [1, 2]), Timing(0.0), on_close=lambda stream: None,
                         abort=lambda request_id: None)


def test_waits_for_the_count_then_returns_everything_queued():
    async def body():
        s, now = new_stream(), time.monotonic()
        task = await pending(s.next_batch(min_events=3))
        s._put(event(1, now), TIMING, now)
        s._put(event(2, now), TIMING, now)
        await asyncio.sleep(0.01)
        assert not task.done()
        s._put(event(3, now), TIMING, now)
        assert [e.token_id for e in await task] == [1, 2, 3]
    run(body())


def test_waits_for_the_oldest_token_to_reach_the_age():
    async def body():
        s, now = new_stream(), time.monotonic()
        task = await pending(s.next_batch(min_events=1, min_age_s=60.0))
        s._put(event(1, now), TIMING, now)
        s._put(event(2, now), TIMING, now + 30)
        await asyncio.sleep(0.01)
        assert not task.done()  # the oldest is 30 s old when the second arrives
        s._put(event(3, now + 61), TIMING, now + 61)
        assert [e.token_id for e in await task] == [1, 2, 3]
    run(body())


def test_max_delay_overrides_the_count():
    async def body():
        s, now = new_stream(), time.monotonic()
        task = await pending(s.next_batch(min_events=100, max_delay_s=1.0))
        s._put(event(1, now), TIMING, now)
        await asyncio.sleep(0.01)
        assert not task.done()
        s._put(event(2, now + 1.5), TIMING, now + 1.5)
        assert len(await task) == 2
    run(body())


def test_the_last_token_and_errors_are_never_held():
    async def body():
        s, now = new_stream(), time.monotonic()
        task = await pending(s.next_batch(min_events=100, min_age_s=60.0))
        s._put(event(1, now), TIMING, now)
        s._put(event(2, now, FinishReason.LENGTH), TIMING, now)
        assert len(await task) == 2 and s.finished
        s2 = new_stream()
        task = await pending(s2.next_batch(min_events=100, min_age_s=60.0))
        s2._put(event(1, now), TIMING, now)
        s2._put(ModelError("boom"), TIMING, now)
        assert len(await task) == 1  # the token first, then the error
        with pytest.raises(ModelError):
            await s2.next_batch()
    run(body())


def test_events_already_queued_are_returned_without_waiting():
    async def body():
        s, now = new_stream(), time.monotonic()
        s._put(event(1, now - 120), TIMING, now)
        s._put(event(2, now - 120), TIMING, now)
        assert len(await s.next_batch(min_events=2, min_age_s=60.0)) == 2
    run(body())


def stream_tokens(srv: ServerThread, max_new_tokens: int) -> list[int]:
    from service.client import Client

    with Client(srv.address, timeout_s=60) as c:
        msgs = list(c.stream_responses("Rom.", max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                       ignore_eos=True, temperature=0.0))
        whole = c.generate("Rom.", max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, ignore_eos=True,
                           temperature=0.0).completions[0]
    assert [t for m in msgs for t in m.token_ids] == list(whole.token_ids)
    assert "".join(m.text for m in msgs) == whole.text
    return [len(m.token_ids) for m in msgs]


def test_every_token_its_own_message_when_asked(engine_bundle):
    s = settings(engine_bundle, stream_interval_ms=0, stream_tokens=1)
    with ServerThread(s, engine_for(s, slowed(0.01))) as srv:
        sizes = stream_tokens(srv, 12)
    assert sizes == [1] * 12


def test_by_default_the_first_token_goes_alone_then_tokens_share_messages(engine_bundle):
    s = settings(engine_bundle, stream_interval_ms=100)  # steps of >= 10 ms: about 10 tokens a message
    with ServerThread(s, engine_for(s, slowed(0.01))) as srv:
        sizes = stream_tokens(srv, 24)
    assert sizes[0] == 1 and sum(sizes) == 24
    assert len(sizes) <= 12 and max(sizes) >= 2
