"""The requests waiting for admission, in the order the scheduler admits them: by priority (lower first),
then by arrival.

    queue = WaitingQueue()
    queue.add(state)          # a new request: behind every waiting one of its priority
    queue.add(state)          # a preempted one: it keeps its priority and its arrival, so it goes back ahead
                              # of every request of its priority that arrived after it
    state = queue[0]          # the next to admit
    queue.popleft()

A request's arrival is the order in which it was first added (`RequestState.arrival_order`), kept across
preemptions. With every priority the same (0 unless asked for), this is first come, first served, and a
preempted request goes back to the head of the queue. Requests mostly arrive at the back, so an insertion
scans from the back.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

from service.engine.sequence import RequestState


class WaitingQueue:
    def __init__(self):
        self._queue: deque[RequestState] = deque()
        self._arrivals = itertools.count()

    @staticmethod
    def _key(state: RequestState) -> tuple[int, int]:
        return state.request.priority, state.arrival_order

    def add(self, state: RequestState) -> None:
        """Queue `state` at its place: a request added the first time gets its arrival number now."""
        if state.arrival_order < 0:
            state.arrival_order = next(self._arrivals)
        key = self._key(state)
        place = len(self._queue)
        while place and self._key(self._queue[place - 1]) > key:
            place -= 1
        self._queue.insert(place, state)

    def popleft(self) -> RequestState:
        return self._queue.popleft()

    def remove(self, state: RequestState) -> None:
        """Take `state` out (ValueError if it is not queued)."""
        self._queue.remove(state)

    def __getitem__(self, index: int) -> RequestState:
        return self._queue[index]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._queue)
