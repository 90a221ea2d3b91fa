"""Replicas of one model, each `attnserve serve` in a child process on loopback, as a Deployment runs them.

    with Fleet(3, bundle, ["--threads", "1"]) as fleet:               # every replica SERVING
        Client(fleet.grpc_target, round_robin=True).generate("Rom.")   # one replica: fleet.replicas[0].address
        asyncio.run(fleet.roll(min_ready_s=3))                         # SIGTERM, drain, start again, one by one

- `Replica`: a `ServerProcess` logging JSON. Its ports are fixed for its whole life, so that a replacement
  takes its place as a Deployment's new pod takes an old one's endpoint; the logs of all its lives are
  kept (`logs`, `log_records`), and its metrics are its own /metrics.
- `Fleet`: the replicas, `grpc_target` for client-side round robin over all of them, `roll()`, and what
  the replicas say about the calls they served: `refusals()` from their logs, `counts()` and `shares()`
  from their metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path

from service.client.server_process import ServerProcess


class Replica(ServerProcess):
    """One `attnserve serve` of a fleet, named `name`, logging JSON into `workdir`."""

    def __init__(self, name: str, args: list[str], workdir: Path):
        super().__init__([*args, "--log-format", "json"], name=name, log_dir=workdir)

    def streaming(self) -> int:
        """Calls it is sending tokens on now, from its metrics: those it sent a first token on, less those that
        ended whole (a call that failed after its first token would count on; none does before a kill)."""
        return round(self.summed("attnserve_time_to_first_token_seconds_count")
                     - self.summed("attnserve_request_duration_seconds_count"))

    def log_records(self) -> list[dict]:
        """Every JSON log line of every life of this replica."""
        records = []
        for path in self.logs:
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
        return records


class Fleet:
    """`count` replicas of one bundle. `args`: more `attnserve serve` options for each."""

    def __init__(self, count: int, bundle: Path | str, args: list[str] = (), workdir: Path | None = None):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="attnserve-fleet-"))
        self.replicas = [Replica(f"r{i}", ["--bundle", str(bundle), *args], self.workdir) for i in range(count)]

    @property
    def grpc_target(self) -> str:
        """Every replica's address, for a channel's round robin: what a headless Service's DNS name resolves to."""
        return "ipv4:" + ",".join(r.address for r in self.replicas)

    def __enter__(self) -> Fleet:
        try:
            for r in self.replicas:  # one at a time: on 2 cores, loading them together is no faster
                r.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for r in self.replicas:
            with contextlib.suppress(RuntimeError):  # one that had to be killed is stopped all the same
                r.stop()

    async def roll(self, min_ready_s: float = 0.0, on_step=None) -> list[dict]:
        """Replace the replicas one at a time, as a rolling update with maxSurge 0 does: SIGTERM, wait for
        the drain and the exit, start the new one on the same ports, wait until it is SERVING, then
        `min_ready_s` more (a Deployment's minReadySeconds) before the next: a balancer that learns of
        health only from failures takes that long to send requests to the new one again."""
        steps = []
        for r in self.replicas:
            t = time.monotonic()
            drain_s = await asyncio.to_thread(r.stop)
            await asyncio.to_thread(r.start)
            steps.append({"replica": r.name, "drain_s": drain_s, "replaced_s": time.monotonic() - t})
            if on_step:
                on_step(steps[-1])
            await asyncio.sleep(min_ready_s)
        return steps

    def refusals(self) -> set[str]:
        """Ids of the requests some replica refused (UNAVAILABLE or 503) before they started: each was sent again."""
        refused = set()
        for r in self.replicas:
            for rec in r.log_records():
                message = rec.get("message", "")
                if "draining" in message or "still loading" in message:
                    rid = rec.get("request_id")
                    if rid and rid != "-":
                        refused.add(rid)
        return refused

    def shares(self, before: dict[str, dict[str, float]], method: str) -> dict[str, float]:
        """Each replica's share of the calls to `method` since `before` (from `counts()`), from its own metrics."""
        now = self.counts(method)
        done = {name: now[name] - before.get(name, 0.0) for name in now}
        total = sum(done.values()) or 1.0
        return {name: n / total for name, n in done.items()}

    def counts(self, method: str) -> dict[str, float]:
        """Finished calls to `method` (an RPC, or an HTTP path) by replica, read from each one's /metrics."""
        out = {}
        for r in self.replicas:
            out[r.name] = sum(v for k, v in r.metrics().items()
                              if k.startswith("attnserve_requests_total{") and f'method="{method}"' in k)
        return out
