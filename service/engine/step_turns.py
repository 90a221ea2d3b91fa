"""Engines of one process taking turns at the cores: one model step at a time, in the order they asked.

    turns = StepTurns()                                   # one per process, given to every engine
    AsyncEngine(config, engine=..., turns=turns)          # each step runs inside `with turns:`

Each engine's onnxruntime session runs its operators on a pool of threads, one per core by default. Two
engines stepping at once put two such pools on the same cores. Taking turns, a step has every core while it
runs, a model alone loses nothing, and two busy models share the time step by step, each step as fast as it
is alone (docs/BENCHMARKS.md, "Several models"). Turns are first come, first served, so a busy engine cannot
take every turn from another. (The sessions of several models also keep their idle threads from spinning:
`create_session(spin=False)`; a spinning pool would take the cores from the engine whose turn it is.)
"""

from __future__ import annotations

import threading


class StepTurns:
    """A first-come, first-served lock over model steps, shared by the engines of a process."""

    def __init__(self):
        self._changed = threading.Condition()
        self._next_ticket = 0  # the number the next engine to ask gets
        self._serving = 0  # the ticket whose holder may step now

    def __enter__(self) -> StepTurns:
        with self._changed:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._changed.wait_for(lambda: self._serving == ticket)
        return self

    def __exit__(self, *exc) -> None:
        with self._changed:
            self._serving += 1
            self._changed.notify_all()
