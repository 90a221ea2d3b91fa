"""Engines taking turns at the cores: one step at a time, in the order they asked."""

from __future__ import annotations

import threading
import time

from service.engine.step_turns import StepTurns


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_turns_go_in_the_order_they_were_asked_for():
    turns = StepTurns()
    order: list[str] = []
    release = threading.Event()

    def first() -> None:
        with turns:
            order.append("first")
            release.wait(30)

    def later(name: str) -> None:
        with turns:
            order.append(name)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    wait_for(lambda: order == ["first"])
    for i, name in enumerate(("second", "third")):
        threads.append(threading.Thread(target=later, args=(name,)))
        threads[-1].start()
        wait_for(lambda i=i: turns._next_ticket == i + 2)  # it has asked, and waits
    assert order == ["first"]  # nobody steps while a step runs
    release.set()
    for t in threads:
        t.join(30)
    assert order == ["first", "second", "third"]


def test_no_two_steps_overlap():
    turns = StepTurns()
    inside, most = 0, 0
    lock = threading.Lock()

    def steps() -> None:
        nonlocal inside, most
        for _ in range(200):
            with turns:
                with lock:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0)
                with lock:
                    inside -= 1

    threads = [threading.Thread(target=steps) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert most == 1 and inside == 0 and turns._serving == 600
