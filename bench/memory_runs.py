"""Servers under a memory-heavy load, for `attnserve bench memory`: attnserve as started with no memory flags
(or a `--memory-budget`), llama.cpp's `llama-server` on the same weights, and what each holds.

    with Served(["--bundle", b]) as s:            # ServerProcess + a watch on its memory and its running requests
        s.startup_s, s.plan()                     # time to SERVING; the start-up log's budget and KV tokens
        s.workload("long", items)                 # all at once over /v1/completions: completed, TTFT, concurrency
        s.long_beside_streams(long, streams)      # one long prompt while short streams decode: their ITL
    with LlamaServed(bin_dir, gguf, context, slots, threads, log) as l: l.workload("long", items)

Every request goes through `bench.serve_http.HttpLoad` (streaming `POST /v1/completions`, token ids as the
prompt, `ignore_eos`), the same client for both servers. A `Watch` thread reads the server's VmRSS and VmHWM
(/proc/<pid>/status) and its running requests (attnserve: `GetServerInfo`; llama.cpp: `GET /slots`) every
half second; a phase's concurrency is the most requests seen running during it.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import numpy as np

from bench import workload
from bench.peers.llama_cpp import LlamaServer
from bench.peers.protocol import peak_rss_bytes
from bench.serve_http import HttpLoad, completion_body
from bench.stats import RequestRecord, percentile
from service.client import Client
from service.client.server_process import ServerProcess

BUDGET_LINE = re.compile(
    r"(memory budget ([\d.]+) GiB .*model ([\d.]+) GiB resident, activations up to ([\d.]+) GiB.*)$", re.M)
KV_LINE = re.compile(r"(KV cache: (\d+) tokens \(\d+ blocks of \d+ positions, ([\d.]+) MiB(?: in \w+)?\).*)$", re.M)
TIMEOUT_S = 4 * 3600.0  # the server-side deadline of each request: a long queue on 2 cores is not a failure


def mixed_items(count: int, lo: int, hi: int, new_tokens: int, vocab: int, seed: int) -> list[workload.Item]:
    """`count` prompts of random ids, lengths uniform in [lo, hi] from `seed`, each asking `new_tokens`."""
    rng = np.random.default_rng(seed)
    return [workload.Item(rng.integers(1, vocab, int(rng.integers(lo, hi + 1))).tolist(), new_tokens)
            for _ in range(count)]


def vm_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid` in bytes ({} once it has exited)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in lines)
            if k in ("VmRSS", "VmHWM")}


class Watch(threading.Thread):
    """Samples (time, VmRSS, running requests, free KV tokens) of a server every `interval` seconds."""

    def __init__(self, pid: int, probe, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.probe, self.interval = pid, probe, interval
        self.samples: list[tuple[float, int, int | None, int | None]] = []
        self.peak = 0  # VmHWM, last read
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            status = vm_status(self.pid)
            try:
                running, free = self.probe()
            except Exception:  # noqa: BLE001 - a busy server may miss a poll; the next one counts
                running, free = None, None
            self.peak = max(self.peak, status.get("VmHWM", 0))
            self.samples.append((time.perf_counter(), status.get("VmRSS", 0), running, free))
            self.done.wait(self.interval)

    def stop(self) -> None:
        self.peak = max(self.peak, peak_rss_bytes(self.pid))
        self.done.set()
        self.join(timeout=10)

    def least_free(self) -> int | None:
        return min((s[3] for s in self.samples if s[3] is not None), default=None)

    def during(self, start: float, end: float) -> dict:
        inside = [s for s in self.samples if start <= s[0] <= end]
        running = [s[2] for s in inside if s[2] is not None]
        free = [s[3] for s in inside if s[3] is not None]
        return {"max_running": max(running, default=None), "min_free_kv_tokens": min(free, default=None),
                "max_rss": max((s[1] for s in inside), default=None), "samples": len(inside)}


def summarize(records: list[RequestRecord], items: list[workload.Item]) -> dict:
    """Completed (every token it asked for), errors by code, TTFT and TTFT per 1,000 prompt tokens."""
    done = [r for r in records if r.ok and r.tokens >= (r.expected_tokens or 0)]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1
    short = sum(1 for r in records if r.ok and r.tokens < (r.expected_tokens or 0))
    ttft = [r.ttft for r in done if r.ttft is not None]
    per_1k = [r.ttft / (len(items[r.client].prompt) / 1000) for r in done if r.ttft is not None]
    q = lambda xs, p: percentile(xs, p) if xs else math.nan  # noqa: E731
    return {"requests": len(records), "completed": len(done), "errors": errors, "short": short,
            "prompt_tokens": sum(len(i.prompt) for i in items),
            "ttft_s": {"p50": q(ttft, 50), "p90": q(ttft, 90), "max": max(ttft, default=math.nan)},
            "ttft_per_1k_s": {"p50": q(per_1k, 50), "p90": q(per_1k, 90)},
            "wall_s": max((r.end for r in records), default=0) - min((r.sent for r in records), default=0)}


async def all_at_once(url: str, items: list[workload.Item], timeout_s: float = TIMEOUT_S) -> list[RequestRecord]:
    """Every item at once; a stream silent for `timeout_s` (+ the load's grace) ends as an error (ReadTimeout)."""
    return await HttpLoad(url).drive([[item] for item in items], timeout_s=timeout_s, stagger=False)


async def beside(url: str, long: workload.Item, streams: list[workload.Item]) -> tuple[RequestRecord,
                                                                                       list[RequestRecord]]:
    """`streams` at once; once each has had its first message, `long`. Every record, when all have ended (a record's
    arrivals are filled in when its request ends, so the first messages are seen through `send`'s pace callback)."""
    load = HttpLoad(url)
    n = len(streams) + 1
    limits = httpx2.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx2.AsyncClient(base_url=load.url, limits=limits, timeout=httpx2.Timeout(TIMEOUT_S + 60)) as http:
        for response in await asyncio.gather(*(http.get("/health") for _ in range(n))):
            response.raise_for_status()  # every connection open before the streams start
        started = [asyncio.Event() for _ in streams]
        records = [RequestRecord(time.perf_counter(), expected_tokens=s.new_tokens, client=i)
                   for i, s in enumerate(streams)]
        tasks = [asyncio.create_task(load.send(http, completion_body(s, i, None, TIMEOUT_S), r,
                                               pace=lambda _tokens, e=e: e.set()))
                 for i, (s, r, e) in enumerate(zip(streams, records, started, strict=True))]
        for task, event in zip(tasks, started, strict=True):
            task.add_done_callback(lambda _task, event=event: event.set())  # a stream that fails: no waiting on it
        await asyncio.wait([asyncio.create_task(e.wait()) for e in started])
        long_record = RequestRecord(time.perf_counter(), expected_tokens=long.new_tokens, client=0)
        await load.send(http, completion_body(long, 999, None, TIMEOUT_S), long_record)
        await asyncio.gather(*tasks)
    return long_record, records


def itl_while(records: list[RequestRecord], start: float, end: float) -> dict:
    """Gaps between the streams' token-carrying messages that end inside [start, end]: p50, p99, max (s)."""
    gaps = [b - a for r in records for a, b in zip(r.token_arrivals, r.token_arrivals[1:], strict=False)
            if start < b <= end]
    return {"n": len(gaps), "p50": percentile(gaps, 50) if gaps else math.nan,
            "p99": percentile(gaps, 99) if gaps else math.nan, "max": max(gaps, default=math.nan)}


@dataclass
class Phase:
    records: list[RequestRecord]
    result: dict


class Served:
    """`attnserve serve` in a child process (`ServerProcess`), watched from start to stop."""

    def __init__(self, args: list[str], log_dir: Path, name: str, start_timeout_s: float = 1800.0):
        self.server = ServerProcess(args, name=name, log_dir=log_dir, start_timeout_s=start_timeout_s,
                                    stop_timeout_s=120.0)
        self.startup_s = math.nan
        self.watch: Watch | None = None
        self.phases: dict[str, dict] = {}

    def __enter__(self) -> Served:
        started = time.perf_counter()
        self.server.__enter__()
        self.startup_s = time.perf_counter() - started
        self.client = Client(self.server.address, timeout_s=30)
        self.watch = Watch(self.server.pid, self._probe)
        self.watch.start()
        return self

    def _probe(self) -> tuple[int, int]:
        info = self.client.server_info()
        return info.requests_running, info.kv_free_tokens

    def model(self) -> dict:
        m = self.client.model_info()
        return {"name": m.name, "graph": m.graph, "vocab": m.vocab_size, "context": m.context_tokens}

    def plan(self) -> dict:
        """The start-up log's memory lines: the budget and where it went, and the tokens the KV cache holds."""
        log = self.server.log()
        budget, kv = BUDGET_LINE.search(log), KV_LINE.search(log)
        info = self.client.server_info()
        return {"budget_line": budget.group(1).strip() if budget else None,
                "budget_gib": float(budget.group(2)) if budget else None,
                "model_gib": float(budget.group(3)) if budget else None,
                "activations_gib": float(budget.group(4)) if budget else None,
                "kv_line": kv.group(1).strip() if kv else None, "kv_tokens": int(kv.group(2)) if kv else None,
                "kv_bytes_per_token": float(kv.group(3)) * 2**20 / int(kv.group(2)) if kv else None,
                "server_info_kv_tokens": info.kv_tokens}

    def preemptions(self) -> float:
        return self.server.metric("attnserve_preemptions_total")

    def workload(self, name: str, items: list[workload.Item]) -> dict:
        before = self.preemptions()
        started = time.perf_counter()
        records = asyncio.run(all_at_once(self.server.http_url, items))
        result = {**summarize(records, items), **self.watch.during(started, time.perf_counter()),
                  "preemptions": self.preemptions() - before}
        self.phases[name] = result
        return result

    def long_beside_streams(self, long: workload.Item, streams: list[workload.Item]) -> dict:
        before = self.preemptions()
        started = time.perf_counter()
        long_record, records = asyncio.run(beside(self.server.http_url, long, streams))
        first = long_record.sent + (long_record.ttft or 0)
        result = {"long": {**summarize([long_record], [long]), "prompt_tokens": len(long.prompt)},
                  "sent_while_streams_ran": bool(long_record.sent < min(r.end for r in records)),
                  "streams": {**summarize(records, streams),
                              "itl_during_prefill_s": itl_while(records, long_record.sent, first),
                              "itl_before_s": itl_while(records, 0, long_record.sent)},
                  **self.watch.during(started, time.perf_counter()), "preemptions": self.preemptions() - before}
        self.phases["long_beside_streams"] = result
        return result

    def __exit__(self, *exc) -> None:
        self.peak_rss = max(self.watch.peak, peak_rss_bytes(self.server.pid)) if self.watch else 0
        if self.watch:
            self.watch.stop()
            self.least_free = self.watch.least_free()
        self.client.close()
        self.server.__exit__(*exc)


class LlamaServed:
    """`llama-server -m X.gguf -c <context> -np <slots> --kv-unified -t <threads>`, watched like `Served`."""

    def __init__(self, bin_dir: Path, gguf: Path, context: int, slots: int, threads: int, log: Path):
        self.server = LlamaServer(bin_dir, gguf, context, threads, log)
        self.server.args = [str(bin_dir / "llama-server"), "-m", str(gguf), "-c", str(context), "-np", str(slots),
                            "--kv-unified", "-t", str(threads), "--host", "127.0.0.1", "--port", str(self.server.port)]
        self.phases: dict[str, dict] = {}

    @property
    def command(self) -> str:
        return " ".join(Path(a).name if a.startswith("/") else a for a in self.server.args)

    def __enter__(self) -> LlamaServed:
        started = time.perf_counter()
        self.server.__enter__()
        self.startup_s = time.perf_counter() - started
        self.watch = Watch(self.server.proc.pid, self._probe)
        self.watch.start()
        return self

    def _probe(self) -> tuple[int, None]:
        slots = httpx2.get(f"{self.server.url}/slots", timeout=5).json()
        return sum(1 for s in slots if s.get("is_processing")), None

    def workload(self, name: str, items: list[workload.Item], timeout_s: float = TIMEOUT_S) -> dict:
        started = time.perf_counter()
        records = asyncio.run(all_at_once(self.server.url, items, timeout_s))
        result = {**summarize(records, items), **self.watch.during(started, time.perf_counter())}
        self.phases[name] = result
        return result

    def log_facts(self) -> dict:
        text = self.server.log.read_text(errors="replace")
        found = {key: re.search(pattern, text) for key, pattern in (
            ("n_ctx_seq", r"n_ctx_seq \((\d+)\)"), ("n_ctx_slot", r"n_ctx_slot = (\d+)"),
            ("n_slots", r"n_slots = (\d+)"), ("kv_unified", r"kv_unified = '(\w+)'"))}
        return {k: (m.group(1) if m else None) for k, m in found.items()}

    def __exit__(self, *exc) -> None:
        self.peak_rss = max(self.watch.peak, peak_rss_bytes(self.server.proc.pid))
        self.watch.stop()
        self.server.__exit__(*exc)
