"""The engine on its own thread behind asyncio: streams, cancellation, back-pressure, shutdown.

Every test runs under `asyncio.wait_for`, so a hang fails instead of blocking the suite. Where the
order of events between the engine thread and the event loop matters, the engine thread is held
at a known model call by a gate, so the outcome never depends on timing.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from service.engine.async_engine import AsyncEngine
from service.engine.errors import Cancelled, DeadlineExceeded, EngineStopped, InvalidRequest, ModelError, Overloaded
from service.engine.request import FinishReason, GenerationRequest, TokenEvent
from tests.engine.harness import (
    TIMEOUT,
    Gate,
    beam,
    check_idle,
    drive,
    eager_speculation,
    greedy,
    random_prompt,
    sampled,
)


def run_async(coro, timeout: float = TIMEOUT):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `condition` on the loop until it holds: what the engine thread publishes settles a step later."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


def async_engine(make_engine, **config) -> AsyncEngine:
    engine = make_engine(**config)
    ae = AsyncEngine(engine.config, engine)
    ae.start()
    return ae


async def consume(stream) -> tuple[list[TokenEvent], BaseException | None]:
    events = []
    try:
        async for e in stream:
            events.append(e)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return events, e
    return events, None


def workload() -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    return [greedy("g0", random_prompt(rng, 7), 20), greedy("g1", random_prompt(rng, 60), 15),
            sampled("s0", random_prompt(rng, 12), 18, seed=3, temperature=0.8, top_p=0.9),
            sampled("s1", random_prompt(rng, 4), 10, seed=4, n=3, temperature=1.0, top_k=30)]


def test_streams_equal_the_sync_engine_and_stats_and_shutdown(make_engine):
    want = drive(make_engine(max_running=8, max_batch_tokens=32), workload())

    async def main():
        ae = async_engine(make_engine, max_running=8, max_batch_tokens=32)
        streams = [ae.submit(r) for r in workload()]
        results = await asyncio.gather(*(consume(s) for s in streams))
        stats = ae.stats()
        await asyncio.wait_for(ae.shutdown(), 10)
        return ae, results, stats

    ae, results, stats = run_async(main())
    total = 0
    for r, (events, error) in zip(workload(), results, strict=True):
        assert error is None
        assert all(isinstance(e, TokenEvent) and e.request_id == r.request_id for e in events)
        for i in range(r.n):
            mine = [e for e in events if e.index == i]
            assert [e.token_id for e in mine] == want.tokens(r.request_id, i)
            assert "".join(e.text for e in mine) == want.text(r.request_id, i)
            assert mine[-1].finish_reason is not None and all(e.finish_reason is None for e in mine[:-1])
            total += len(mine)
    assert stats.generated_tokens == total and stats.tokens_per_s > 0
    assert stats.running_requests == 0 and stats.running_sequences == 0 and stats.waiting_requests == 0
    assert stats.kv_free_slots == stats.kv_slots == 8
    assert ae._thread is None and not ae.engine.has_work


def test_cancelling_the_consumer_aborts_the_request_and_frees_its_slot(make_engine):
    async def main():
        ae = async_engine(make_engine, max_running=4, max_batch_tokens=32)
        gate = Gate(ae.engine, at=3)
        got: list[TokenEvent] = []

        async def reader():
            async for e in ae.submit(sampled("victim", [5, 6, 7], 100, seed=1, n=2, temperature=1.0,
                                             stopping=dict(ignore_eos=True))):
                got.append(e)

        task = asyncio.create_task(reader())
        await gate.wait_reached()  # 2 decode steps done, the third is held
        await until(lambda: len(got) >= 2)
        assert ae.stats().running_sequences == 2 and ae.stats().kv_free_slots == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()
        await until(lambda: not ae.engine.has_work and ae.stats().kv_free_slots == 4)
        stats = ae.stats()
        assert stats.running_requests == 0 and stats.running_sequences == 0
        assert stats.generated_tokens < 2 * 100  # aborted, not run to the end
        # the engine serves on
        events, error = await consume(ae.submit(greedy("next", [1, 2, 3], 5)))
        await ae.shutdown()
        return events, error

    events, error = run_async(main())
    assert error is None and len(events) == 5 and events[-1].finish_reason is FinishReason.LENGTH


def test_a_whole_request_gets_its_events_at_its_end_and_can_still_be_cancelled(make_engine):
    """Submitted `whole`, a request's events arrive together once it has ended, the same events as
    step by step; cancelled while it runs, it is aborted all the same."""
    async def main():
        ae = async_engine(make_engine, max_running=4, max_batch_tokens=32)
        want, _ = await consume(ae.submit(sampled("step", [5, 6, 7], 12, seed=2, n=2, temperature=1.0)))
        gate = Gate(ae.engine, at=4)
        stream = ae.submit(sampled("whole", [5, 6, 7], 12, seed=2, n=2, temperature=1.0), whole=True)
        await gate.wait_reached()  # 3 decode steps done, their tokens held by the engine thread
        queued_mid_run = len(stream._items)
        gate.open()
        got = await stream.next_batch()
        rest = await stream.next_batch()
        gate = Gate(ae.engine, at=3)
        cancelled = ae.submit(greedy("gone", [5, 6, 7], 100, ignore_eos=True), whole=True)
        reader = asyncio.create_task(cancelled.next_batch())
        await gate.wait_reached()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        gate.open()
        await until(lambda: not ae.engine.has_work and ae.stats().kv_free_slots == 4)
        generated = ae.stats().generated_tokens
        await ae.shutdown()
        return want, got, rest, queued_mid_run, generated

    want, got, rest, queued_mid_run, generated = run_async(main())
    assert queued_mid_run == 0 and rest == []
    assert [(e.index, e.token_id, e.finish_reason) for e in got] == [(e.index, e.token_id, e.finish_reason)
                                                                      for e in want]
    assert generated < 2 * 2 * 12 + 100  # the cancelled one did not run to the end


def test_abort_by_id_ends_the_stream_with_cancelled(make_engine):
    async def main():
        ae = async_engine(make_engine, max_running=4, max_batch_tokens=32)
        gate = Gate(ae.engine, at=2)
        stream = ae.submit(greedy("x", [5, 6, 7], 100, ignore_eos=True))
        await gate.wait_reached()
        ae.abort("x")
        gate.open()
        result = await consume(stream)
        await until(lambda: ae.stats().kv_free_slots == 4)
        await ae.shutdown()
        return result

    events, error = run_async(main())
    assert isinstance(error, Cancelled) and 0 < len(events) < 100


def test_submit_raises_overloaded_when_the_engine_is_full(make_engine):
    async def main():
        ae = async_engine(make_engine, max_running=1, max_waiting=1, max_batch_tokens=16)
        gate = Gate(ae.engine, at=1)  # the first decode step is held: "a" keeps the only slot
        a = ae.submit(greedy("a", [1, 2, 3], 8))
        await gate.wait_reached()
        assert ae.stats().running_sequences == 1 and ae.stats().kv_free_slots == 0
        b = ae.submit(greedy("b", [4, 5], 8))  # queued: the one waiting place
        with pytest.raises(Overloaded):
            ae.submit(greedy("c", [6, 7], 8))
        with pytest.raises(Overloaded):
            ae.submit(greedy("d", [6, 7], 8))
        gate.open()
        results = await asyncio.gather(consume(a), consume(b))
        late = await consume(ae.submit(greedy("c", [6, 7], 8)))  # room again
        await ae.shutdown()
        return results, late

    results, late = run_async(main())
    for events, error in results + [late]:
        assert error is None and len(events) == 8


def test_max_waiting_zero_still_serves_an_idle_engine(make_engine):
    """max_waiting counts requests queued beyond the running ones, and the config allows 0: an idle
    engine with free slots must still take a request, and refuse one only when its slots are promised."""

    async def main():
        ae = async_engine(make_engine, max_running=2, max_waiting=0, max_batch_tokens=16)
        gate = Gate(ae.engine, at=1)
        a = ae.submit(greedy("a", [1, 2, 3], 4))
        await gate.wait_reached()
        b = ae.submit(greedy("b", [4, 5, 6], 4))  # the second slot
        with pytest.raises(Overloaded):
            ae.submit(greedy("c", [7, 8], 4))
        gate.open()
        results = await asyncio.gather(consume(a), consume(b))
        await ae.shutdown()
        return results

    assert [(len(events), error) for events, error in run_async(main())] == [(4, None), (4, None)]


def test_requests_accepted_while_there_is_room_are_served(make_engine):
    """`submit` refuses with Overloaded only when the queue is full *and* the engine has no room
    (AsyncEngine._no_room_now). With 7 of 8 slots free and max_waiting=2, four requests submitted
    together are accepted by `submit`, so none of them may fail afterwards with Overloaded."""

    async def main():
        ae = async_engine(make_engine, max_running=8, max_waiting=2, max_batch_tokens=64)
        gate = Gate(ae.engine, at=1)  # hold the engine thread so the four arrive in one batch
        first = ae.submit(greedy("first", [9, 9, 9], 6))
        await gate.wait_reached()
        assert ae.stats().kv_free_slots == 7
        streams = [ae.submit(greedy(f"r{i}", [i + 1, 2, 3], 6)) for i in range(4)]
        gate.open()
        results = await asyncio.gather(*(consume(s) for s in [first] + streams))
        await ae.shutdown()
        return results

    for events, error in run_async(main()):
        assert error is None, repr(error)
        assert len(events) == 6


def test_requests_of_several_sequences_in_flight_are_counted_by_their_sequences(make_engine):
    """Two n=4 requests submitted together while 7 of 8 slots are free and max_waiting=0: only one
    fits. `submit` must refuse the second itself; once it has accepted a request, that request may
    not fail later with Overloaded."""

    async def main():
        ae = async_engine(make_engine, max_running=8, max_waiting=0, max_batch_tokens=64)
        gate = Gate(ae.engine, at=1)
        first = ae.submit(greedy("first", [9, 9, 9], 6))
        await gate.wait_reached()
        assert ae.stats().kv_free_slots == 7
        a = ae.submit(sampled("a", [1, 2, 3], 6, seed=1, n=4, temperature=1.0))
        try:
            b = ae.submit(sampled("b", [4, 5, 6], 6, seed=2, n=4, temperature=1.0))
        except Overloaded:
            b = None
        gate.open()
        results = await asyncio.gather(*(consume(s) for s in (first, a, b) if s is not None))
        await ae.shutdown()
        return results

    results = run_async(main())
    assert [repr(error) for _, error in results] == ["None"] * len(results)
    assert [len(events) for events, _ in results[:2]] == [6, 4 * 6]


class DeadlineClock:
    """The clock the engine thread checks deadlines against (`Engine.expire`), moved on by the test: a
    deadline passes exactly where the test says, however long the machine took to get there."""

    def __init__(self, engine):
        self.ahead_s = 0.0
        expire = engine.expire
        engine.expire = lambda now=None: expire((time.monotonic() if now is None else now) + self.ahead_s)


def test_deadlines_in_the_queue_and_while_running(make_engine):
    async def main():
        ae = async_engine(make_engine, max_running=2, max_batch_tokens=32)
        past = greedy("past", [1, 2, 3], 5)
        past.deadline = time.monotonic() - 1
        expired_in_queue = await consume(ae.submit(past))

        gate, clock = Gate(ae.engine, at=3), DeadlineClock(ae.engine)
        soon = greedy("soon", [4, 5, 6], 100, ignore_eos=True)
        soon.deadline = time.monotonic() + 60
        other = greedy("other", [7, 8], 12, ignore_eos=True)
        s1, s2 = ae.submit(soon), ae.submit(other)
        await gate.wait_reached()  # "soon" has been prefilled and decoded twice
        clock.ahead_s = 61  # the deadline passes mid-step
        gate.open()
        running = await asyncio.gather(consume(s1), consume(s2))
        await until(lambda: ae.stats().kv_free_slots == 2 and ae.stats().running_sequences == 0)
        await ae.shutdown()
        return expired_in_queue, running

    (events, error), ((soon_events, soon_error), (other_events, other_error)) = run_async(main())
    assert events == [] and isinstance(error, DeadlineExceeded)
    assert isinstance(soon_error, DeadlineExceeded) and 0 < len(soon_events) < 100
    assert other_error is None and len(other_events) == 12


def test_invalid_requests_raise_in_submit(make_engine):
    async def main():
        ae = async_engine(make_engine, max_running=2, max_batch_tokens=32)
        with pytest.raises(InvalidRequest) as e:
            ae.submit(greedy("bad", [], 5))
        assert e.value.field == "prompt"
        gate = Gate(ae.engine, at=1)
        first = ae.submit(greedy("dup", [1, 2], 6))
        with pytest.raises(InvalidRequest) as e:
            ae.submit(greedy("dup", [3, 4], 6))
        assert e.value.field == "request_id"
        gate.open()
        result = await consume(first)
        await ae.shutdown()
        with pytest.raises(EngineStopped):
            ae.submit(greedy("after", [1], 2))
        return result

    events, error = run_async(main())
    assert error is None and len(events) == 6


def test_a_model_fault_reaches_the_stream_and_the_engine_serves_on(make_engine):
    async def main():
        ae = async_engine(make_engine, max_running=4, max_batch_tokens=32)
        original = ae.engine.runner.decode
        calls = {"n": 0}

        def flaky(ids, positions):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected")
            return original(ids, positions)

        ae.engine.runner.decode = flaky
        hit = await consume(ae.submit(greedy("hit", [1, 2, 3], 10)))
        after = await consume(ae.submit(greedy("after", [1, 2, 3], 10)))
        stats = ae.stats()
        await ae.shutdown()
        return hit, after, stats

    (hit_events, hit_error), (after_events, after_error), stats = run_async(main())
    assert isinstance(hit_error, ModelError) and len(hit_events) == 2
    assert after_error is None and len(after_events) == 10
    assert [e.token_id for e in after_events[:2]] == [e.token_id for e in hit_events]
    assert stats.kv_free_slots == 4


def test_shutdown_finishes_the_work_in_flight(make_engine):
    async def main():
        ae = async_engine(make_engine, max_running=4, max_batch_tokens=32)
        stream = ae.submit(greedy("x", [1, 2, 3], 30, ignore_eos=True))
        consumer = asyncio.create_task(consume(stream))
        await asyncio.wait_for(ae.shutdown(), 10)
        return await consumer

    events, error = run_async(main())
    assert error is None and len(events) == 30


# ---- one owner -----------------------------------------------------------------------------------

def watch_threads(obj, threads: set[str]) -> None:
    """Record in `threads` the name of every thread that reads an attribute of `obj` from now on."""
    cls = type(obj)

    class Watched(cls):  # the same object; every attribute read recorded
        def __getattribute__(self, name):
            threads.add(threading.current_thread().name)
            return cls.__getattribute__(self, name)

    obj.__class__ = Watched


def test_only_the_engine_thread_touches_engine_state(make_engine):
    """Submitting, reading stats and cancelling from the event loop never reads or writes the scheduler
    or the KV cache: the loop talks to the engine thread through its queue and published counters."""

    async def main():
        ae = async_engine(make_engine, max_running=2, max_waiting=8, max_batch_tokens=32)
        threads: set[str] = set()
        for state in (ae.engine.scheduler, ae.engine.kv):
            watch_threads(state, threads)
        streams = [ae.submit(greedy(f"r{i}", [1 + i, 2, 3], 12)) for i in range(5)]
        ae.stats()
        streams[4].cancel()
        results = await asyncio.gather(*(consume(s) for s in streams[:4]))
        await ae.shutdown()
        return threads, results

    threads, results = run_async(main())
    assert threads == {"attnserve-engine"}
    assert all(error is None and len(events) == 12 for events, error in results)


def test_submit_and_cancel_hammered_from_many_tasks(make_engine):
    """64 tasks submit, read, cancel and abort at random while the engine steps. Admission is decided
    once, in `submit`: an accepted request is never refused later. Every accepted stream ends once
    (finished, cancelled, or expired), and afterwards every slot and counter is back where it began."""
    rng = np.random.default_rng(11)

    async def client(ae: AsyncEngine, i: int, outcomes: list) -> None:
        for j in range(6):
            n = int(rng.integers(1, 4))
            request = sampled(f"t{i}-{j}", random_prompt(rng, int(rng.integers(1, 40))), int(rng.integers(1, 24)),
                              seed=i * 100 + j, n=n, temperature=0.9)
            if rng.random() < 0.15:
                request.deadline = time.monotonic() + float(rng.uniform(0.0, 0.05))
            try:
                stream = ae.submit(request)
            except Overloaded:
                outcomes.append("refused")
                await asyncio.sleep(0.001)
                continue
            stop_after = int(rng.integers(0, 12)) if rng.random() < 0.4 else None
            events, error = [], None
            try:
                async for event in stream:
                    events.append(event)
                    if stop_after is not None and len(events) >= stop_after:
                        stream.cancel() if rng.random() < 0.5 else ae.abort(request.request_id)
            except Exception as e:  # noqa: BLE001 - the error is the outcome
                error = e
            assert not isinstance(error, Overloaded), "an accepted request was refused later"
            assert error is None or isinstance(error, Cancelled | DeadlineExceeded), repr(error)
            if error is None and stop_after is None:
                finished = [e for e in events if e.finish_reason is not None]
                assert sorted(e.index for e in finished) == list(range(n))
            assert ae.stats().running_sequences <= ae.engine.kv.n_slots
            outcomes.append("accepted")

    async def main():
        ae = async_engine(make_engine, max_running=6, max_waiting=3, max_batch_tokens=48)
        outcomes: list[str] = []
        await asyncio.gather(*(client(ae, i, outcomes) for i in range(64)))
        # a prompt's first token reaches the loop mid-step, before the step's stats are published: a request
        # cancelled on it leaves `in_flight` at once while the published stats still count it as waiting,
        # until the engine thread has taken the abort. Wait for the counts asserted below.
        await until(lambda: ae.in_flight == 0 and settled(ae.stats()), what="every count back to idle")
        stats = ae.stats()
        await ae.shutdown()
        return ae, outcomes, stats

    def settled(s) -> bool:
        return (s.running_requests, s.waiting_requests, s.kv_free_slots) == (0, 0, s.kv_slots)

    ae, outcomes, stats = run_async(main(), timeout=120)
    assert "accepted" in outcomes and "refused" in outcomes and len(outcomes) == 64 * 6
    check_idle(ae.engine)
    assert (stats.running_requests, stats.waiting_requests, stats.kv_free_slots) == (0, 0, stats.kv_slots)


def mixed_load() -> tuple[list[GenerationRequest], list[GenerationRequest]]:
    """Two waves of requests of every kind the sample phase tells apart: beam searches, prompts scored
    (`prompt_logprobs`), and greedy and seeded rows whose repetitive prompts give speculation drafts."""
    rng = np.random.default_rng(12)

    def repetitive(length: int = 28) -> list[int]:
        return (random_prompt(rng, 6) * 5)[:length]

    def scored(rid: str) -> GenerationRequest:
        r = greedy(rid, repetitive(), 20)
        r.prompt_logprobs = 2
        return r
    first = [beam("b0", repetitive(), width=3, n=2, max_new=14), greedy("g0", repetitive(), 24), scored("p0")]
    second = [beam("b1", repetitive(), width=2, n=1, max_new=12), sampled("s0", repetitive(), 20, seed=7),
              scored("p1"), greedy("g1", repetitive(), 24)]
    return first, second


def test_beams_and_scored_prompts_run_beside_speculating_requests(make_engine):
    """Under load, with speculation on (and taken whenever a row has drafts), beam searches and scored prompts
    arrive while other requests decode: none fails, the engine stays healthy, and every request gives what
    the engine gives with speculation off."""
    first, second = mixed_load()
    want = drive(make_engine(), first + second)

    async def main():
        engine = make_engine(speculative="ngram", speculative_tokens=4)
        eager_speculation(engine)
        engine.warm_up()
        ae = AsyncEngine(engine.config, engine)
        ae.start()
        streams = [ae.submit(r, whole=r.request_id == "p0") for r in first]
        await until(lambda: ae.stats().generated_tokens > 4, what="the first wave decoding")
        streams += [ae.submit(r, whole=r.request_id == "b1") for r in second]
        results = await asyncio.gather(*(consume(s) for s in streams))
        stats = ae.stats()
        await asyncio.wait_for(ae.shutdown(), 10)
        return results, stats

    results, stats = run_async(main())
    for r, (events, error) in zip(first + second, results, strict=True):
        assert error is None, (r.request_id, error)
        for i in range(r.n):
            mine = [e for e in events if e.index == i]
            assert [e.token_id for e in mine] == want.tokens(r.request_id, i), (r.request_id, i)
            assert mine[0].prompt_logprobs == want.events[(r.request_id, i)][0].prompt_logprobs
            assert mine[-1].beam_score == want.events[(r.request_id, i)][-1].beam_score
    assert stats.speculation.draft_tokens > 0 and stats.running_requests == 0 and stats.kv_free_slots == stats.kv_slots
