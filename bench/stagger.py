"""When the load generator's clients start: staggered on client 0's progress, or all at once.

    gate = Stagger(clients=4, first_tokens=40)   # client i starts once client 0's first request has i·40/4 tokens
    await gate.wait(c)                            # in client c, before its first request
    gate.progressed(n)                            # client 0's first request received n more tokens
    gate.release()                                # client 0's first request ended: nobody waits any longer

Spreading the starts over client 0's first request puts arrivals where a steady load would, rather than
c prompts landing in the same engine step. Every protocol's driver paces its clients with this one gate.
"""

from __future__ import annotations

import asyncio


class Stagger:
    def __init__(self, clients: int, first_tokens: int, on: bool = True):
        self.starts = [asyncio.Event() for _ in range(clients)]
        self.thresholds = [i * first_tokens / clients for i in range(clients)]  # tokens client 0 has received
        self.received = 0.0
        if self.starts:
            self.starts[0].set()
        if not on:
            self.release()

    async def wait(self, client: int) -> None:
        await self.starts[client].wait()

    def progressed(self, tokens: float) -> None:
        self.received += tokens
        for start, threshold in zip(self.starts, self.thresholds, strict=True):
            if not start.is_set() and self.received >= threshold:
                start.set()

    def release(self) -> None:
        """Start everyone still waiting (client 0's first request ended, however it ended)."""
        for start in self.starts:
            start.set()
