"""The systems of `attnserve bench compare --real-shapes`, one run each: a server (attnserve's `attnserve serve`,
or llama.cpp's `llama-server`) started, measured through its own API and stopped, or `llama-batched-bench` run
once per point. What each measures and how is in bench/commands/compare_real.py's docstring; the arithmetic
is bench/real_report.py's.

    plan = Plan(prefill=(512, 4000), decode_after=(512,), batches=(1, 8), new_tokens=64, mixed=..., ...)
    run = attnserve_run(bundle, ["--graph", "static-int8", ...], plan, logs, print)   # a run dict
    run = llama_server_run(bin_dir, gguf, plan, work, print)
    run = batched_bench_run(bin_dir, gguf, plan, (512, 4000), work, print)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import workload
from bench.peers.llama_cpp import SLOTS, Completions, LlamaServer, batched_bench_rows
from bench.peers.protocol import peak_rss_bytes
from bench.real_report import all_decoding, decode_rate, mixed_summary
from bench.stats import RequestRecord

TIMEOUT_S = 3 * 3600.0  # a request's deadline: a 16,000-token prefill on 2 cores takes minutes
WARM_UP_TOKENS = 16  # the untimed request each server gets first
TTFT_SUM, TTFT_COUNT = "attnserve_time_to_first_token_seconds_sum", "attnserve_time_to_first_token_seconds_count"
PREFILL, DECODE = 1, 2  # which prompts: the seeds of `Plan.prompt`
LLAMA_FLAGS = ("-fa", "on", "-ub", "512", "-b", "2048")  # batched-bench and server alike (flash attention: the
# faster prefill here, 135.6 against 119.6 tok/s at 4,096 tokens)


@dataclass(frozen=True)
class Plan:
    """The points every system is measured at, and the prompts it gets."""

    prefill: tuple[int, ...]  # prompt tokens of each prefill point (1 new token)
    decode_after: tuple[int, ...]  # prompt tokens before each decode point
    batches: tuple[int, ...]  # concurrent streams of each decode point
    new_tokens: int  # tokens each decode stream generates
    mixed: tuple[workload.Item, ...]  # the mixed load's requests, in arrival order
    mixed_interval_s: float  # seconds between the mixed load's arrivals
    vocab: int  # prompts are random ids in [1, vocab)
    seed: int

    def prompt(self, length: int, purpose: int) -> list[int]:
        """The same random ids for every system: one prompt per (purpose, length)."""
        rng = np.random.default_rng([self.seed, purpose, length])
        return rng.integers(1, self.vocab, length).tolist()

    def longest(self) -> int:
        """The most positions one sequence takes."""
        return max([p + 1 for p in self.prefill] + [p + self.new_tokens for p in self.decode_after]
                   + [len(i.prompt) + i.new_tokens for i in self.mixed])

    def most_in_flight(self) -> int:
        """The most positions held at once: the widest decode (each stream its own copy of the prompt), all of
        the mixed load, or the longest prefill."""
        decode = max(b * (p + self.new_tokens) for p in self.decode_after for b in self.batches)
        return max(decode, sum(len(i.prompt) + i.new_tokens for i in self.mixed), max(self.prefill) + 1)


# ---- the servers' common measure ---------------------------------------------------------------------------


class Front:
    """How a server is asked for tokens: `connected(n)` opens room for `n` requests at once and yields
    `send(prompt, new_tokens) -> RequestRecord` (exactly `new_tokens` greedy tokens, each message's arrival)."""

    def connected(self, n: int):
        raise NotImplementedError

    def server_ttft(self) -> tuple[float, float] | None:
        """The server's own TTFT histogram (sum, count), if it has one."""
        return None


class AttnserveFront(Front):
    def __init__(self, client, server):
        self.client, self.server = client, server  # an AsyncClient, and the ServerProcess for its metrics

    @contextlib.asynccontextmanager
    async def connected(self, n: int):
        yield self.send

    async def send(self, prompt: list[int], new_tokens: int) -> RequestRecord:
        record = RequestRecord(time.perf_counter(), expected_tokens=new_tokens)
        async for msg in self.client.stream_responses(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                      ignore_eos=True, temperature=0.0, timeout_s=TIMEOUT_S):
            if msg.token_ids:
                record.arrived(time.perf_counter(), len(msg.token_ids))
        if record.tokens != new_tokens:
            raise RuntimeError(f"attnserve returned {record.tokens} of {new_tokens} tokens")
        return record

    def server_ttft(self) -> tuple[float, float]:
        return self.server.summed(TTFT_SUM), self.server.summed(TTFT_COUNT)


class LlamaFront(Front):
    """llama-server's streamed `POST /completion` with `cache_prompt`, so a shared prompt is reused."""

    def __init__(self, url: str):
        self.url = url
        self.retried = 0

    @contextlib.asynccontextmanager
    async def connected(self, n: int):
        async with Completions.connected(self.url, n) as client:
            yield lambda prompt, new_tokens: client.stream(prompt, new_tokens, cache_prompt=True)
            self.retried += client.retried


async def measure_server(front: Front, plan: Plan, log: Callable[[str], None]) -> dict:
    """Prefill at each length, decode at each (prompt, streams) point, the mixed load: a run's figures."""
    async with front.connected(1) as send:
        await send(plan.prompt(WARM_UP_TOKENS, 0), 2)
    prefill, prefill_server = {}, {}
    for p in plan.prefill:
        before = front.server_ttft()
        async with front.connected(1) as send:
            record = await send(plan.prompt(p, PREFILL), 1)
        prefill[str(p)] = p / record.ttft
        after = front.server_ttft()
        if before and after and after[1] > before[1]:
            prefill_server[str(p)] = p / ((after[0] - before[0]) / (after[1] - before[1]))
        log(f"      prefill {p:>6,} tokens: {prefill[str(p)]:8.1f} tok/s (TTFT {record.ttft:.2f} s)")
    decode, apart = {}, []  # apart: the points whose streams never all decoded at once
    for p in plan.decode_after:
        prompt = plan.prompt(p, DECODE)
        async with front.connected(1) as send:
            await send(prompt, 1)  # the prompt computed once: a prefix cache holds it from here
        decode[str(p)] = {}
        for b in plan.batches:
            async with front.connected(b) as send:
                records = await asyncio.gather(*(send(prompt, plan.new_tokens) for _ in range(b)))
            arrivals = [[a for a in r.arrivals if a[1] > 0] for r in records]
            decode[str(p)][str(b)] = decode_rate(arrivals)
            if b > 1 and not all_decoding(arrivals):
                apart.append(f"{p}x{b}")
            log(f"      decode after {p:>6,}, {b:>2} streams: {decode[str(p)][str(b)]:8.1f} tok/s")
    mixed = await mixed_load(front, plan)
    log(f"      mixed load: TTFT p50 {mixed['ttft_p50_s']:.2f} s, p99 {mixed['ttft_p99_s']:.2f} s, "
        f"{mixed['total_s']:.1f} s in all")
    return {"prefill": prefill, "prefill_server": prefill_server, "decode": decode, "decode_apart": apart,
            "mixed": mixed}


async def mixed_load(front: Front, plan: Plan) -> dict:
    """The mixed load's requests, one every `plan.mixed_interval_s` from the first: TTFT p50/p99, wall time."""
    async with front.connected(len(plan.mixed)) as send:
        start = time.perf_counter()

        async def one(i: int, item: workload.Item) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + i * plan.mixed_interval_s - time.perf_counter()))
            return await send(item.prompt, item.new_tokens)

        records = await asyncio.gather(*(one(i, item) for i, item in enumerate(plan.mixed)))
    return mixed_summary([r.sent for r in records], [r.sent + r.ttft if r.ttft is not None else None
                                                     for r in records], [r.end for r in records])


# ---- attnserve ---------------------------------------------------------------------------------------------


def attnserve_run(bundle: Path, flags: list[str], plan: Plan, log_dir: Path, name: str,
                  log: Callable[[str], None]) -> dict:
    """`attnserve serve --bundle <bundle> <flags>` measured over gRPC; the graph it served and its peak RSS. Its
    log is `<log_dir>/<name>.1.log`."""
    from service.client import AsyncClient
    from service.client.server_process import ServerProcess

    args = ["--bundle", str(bundle), *flags]
    with ServerProcess(args, name=name, log_dir=log_dir, start_timeout_s=3600.0,
                       stop_timeout_s=120.0) as server:
        async def measured() -> tuple[dict, str]:
            async with AsyncClient(server.address, timeout_s=TIMEOUT_S) as client:
                graph = (await client.model_info()).graph
                log(f"      serving the {graph} graph")
                return await measure_server(AttnserveFront(client, server), plan, log), graph

        run, graph = asyncio.run(measured())
        run["peak_rss_bytes"] = peak_rss_bytes(server.pid)
    run["graph"] = graph
    run["settings"] = {"command": "attnserve serve " + " ".join(args),
                       "api": "gRPC GenerateStream, token ids, temperature 0, min_new_tokens = max_new_tokens, "
                              "ignore_eos; one channel"}
    return run


# ---- llama.cpp ---------------------------------------------------------------------------------------------


def llama_server_run(bin_dir: Path, gguf: Path, plan: Plan, threads: int, work: Path,
                     log: Callable[[str], None]) -> dict:
    """`llama-server` with one unified KV cache (--kv-unified) as large as the most positions in flight, so that
    every slot may take what it needs of it (without it, each of the 32 slots gets -c / 32)."""
    slots_needed(plan)
    context = plan.most_in_flight() + 256
    server = LlamaServer(bin_dir, gguf, context, threads, work / f"{gguf.stem}-server.log",
                         extra=(*LLAMA_FLAGS, "--kv-unified"))
    with server:
        front = LlamaFront(server.url)
        run = asyncio.run(measure_server(front, plan, log))
        run["peak_rss_bytes"] = server.peak_rss_bytes()
    run["settings"] = {"command": " ".join(Path(a).name if a.startswith("/") else a for a in server.args),
                       "api": "its completion endpoint streamed, token ids, top_k 1, ignore_eos, cache_prompt true",
                       "retried": front.retried}
    return run


def batched_bench_command(bin_dir: Path, gguf: Path, threads: int, prompt: int, new_tokens: int,
                          batches: tuple[int, ...], shared: bool) -> list[str]:
    """`llama-batched-bench` at one prompt length; the batches end with a 1 whose row may be lost
    (`batched_bench_rows`). A shared prompt is held once (-pps with --kv-unified): -c is that plus each
    sequence's new tokens; else each sequence holds its own."""
    context = (prompt + max(batches) * new_tokens if shared else max(batches) * (prompt + new_tokens)) + 16
    return [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(context), "-npp", str(prompt),
            "-ntg", str(new_tokens), "-npl", ",".join(map(str, (*batches, 1))), "-t", str(threads), "-tb", str(threads),
            *LLAMA_FLAGS, *(("-pps", "--kv-unified") if shared else ()), "--output-format", "jsonl"]


def batched_bench_run(bin_dir: Path, gguf: Path, plan: Plan, prefill: tuple[int, ...], threads: int, work: Path,
                      log: Callable[[str], None]) -> dict:
    """Prefill at each of `prefill` (its S_PP at -ntg 1 -npl 1) and decode at each point of the plan (its S_TG,
    the prompt shared); one process per prompt length."""
    logfile, peak, commands = work / f"{gguf.stem}-batched-bench.log", 0, []
    prefill_rates = {}
    for p in prefill:
        cmd = batched_bench_command(bin_dir, gguf, threads, p, 1, (1,), shared=False)
        rows, rss = batched_bench_rows(cmd, logfile, (1,))
        prefill_rates[str(p)], peak = rows[1]["speed_pp"], max(peak, rss)
        commands.append(cmd)
        log(f"      prefill {p:>6,} tokens: {prefill_rates[str(p)]:8.1f} tok/s")
    decode = {}
    for p in plan.decode_after:
        cmd = batched_bench_command(bin_dir, gguf, threads, p, plan.new_tokens, plan.batches, shared=True)
        rows, rss = batched_bench_rows(cmd, logfile, plan.batches)
        decode[str(p)], peak = {str(b): rows[b]["speed_tg"] for b in plan.batches}, max(peak, rss)
        commands.append(cmd)
        log(f"      decode after {p:>6,}: " + ", ".join(f"{b} streams {v:.1f}" for b, v in decode[str(p)].items())
            + " tok/s")
    shown = [" ".join(Path(a).name if a.startswith("/") else a for a in cmd) for cmd in commands]
    return {"prefill": prefill_rates, "decode": decode, "peak_rss_bytes": peak,
            "settings": {"commands": " ; ".join(shown),
                         "figures": "prefill: its speed_pp (S_PP); decode: its speed_tg (S_TG), the prompt shared"}}


def gguf_bytes_per_token(gguf: Path) -> int:
    """Bytes of the GGUF's tensors a batch-1 decode step reads: all but the token embedding, which it only looks
    rows up in, unless the output head is tied to it (no `output.weight`): then the head reads it whole."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    tied = "output.weight" not in sizes
    return sum(n for name, n in sizes.items() if name != "token_embd.weight" or tied)


def slots_needed(plan: Plan) -> int:
    """llama-server's --parallel must cover the widest decode and the mixed load."""
    needed = max(max(plan.batches), len(plan.mixed))
    if needed > SLOTS:
        raise ValueError(f"{needed} requests at once: llama-server runs with {SLOTS} slots")
    return needed
