"""`attnserve bench serve`: a load generator of concurrent streaming clients, over gRPC or HTTP.

    attnserve bench serve --server localhost:50051 --concurrency 1,8,32,64 --prompt-tokens 16 --new-tokens 128
    attnserve bench serve --bundle models/shakespeare-onnx ...    # start a server for the run, then stop it
    attnserve bench serve --server ... --mixed                     # prompts 8-512, new tokens 16-256 (seeded)
    attnserve bench serve --bundle ... --concurrency 1,2 --new-tokens 4 --requests-per-client 1 --no-write  # seconds
    attnserve bench serve --protocol http --server http://localhost:8000 ...   # the same load over /v1/completions

For each concurrency c it opens c streaming clients on one channel, each sending
`--requests-per-client` requests one after another, with `ignore_eos` so that every request
generates exactly the tokens it asks for. The clients start staggered: client i sends its first
request when client 0's first request is i/c of the way through, so arrivals are spread as in a
steady load rather than in lock-step waves. It reports generated tokens/s and requests/s over the
steady window (every client busy; `bench.stats`), TTFT p50/p90/p99, inter-token latency p50/p99,
end-to-end p50/p99 and errors by status code, and writes docs/bench/serve[-mixed].json, the
serve section of docs/BENCHMARKS.md and PNG plots next to the JSON. The server serves the graph it
chooses (`--server-arg=--graph=NAME` to pin one); the results name it.

`--noop-check` first drives a no-op server (`bench.noop_server`) with the same clients at the
highest concurrency: the tokens/s the client side takes in there bounds its own overhead.

`--protocol http` sends the same plan (same prompts, seeds, stagger) as streaming
`POST /v1/completions` requests to the HTTP front, one keep-alive connection per client
(`bench.serve_http`, which says what of its figures is exact), and writes
docs/bench/serve-http[-mixed].json, its own BENCHMARKS.md section and its plots, beside the gRPC ones.
`--server` is then the HTTP base URL (`http://host:port`; a bare `host:port` means http://). The
model's vocabulary and context (for the plan) and its graph (for the results) are not in the OpenAI
API: they are read over gRPC from the same server, at `--grpc-server` (default: the `--server` host on
port 50051). With `--bundle`, both are the started server's ports.
"""

from __future__ import annotations

import asyncio
import functools
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import grpc

from attnserve.arguments import HintingParser
from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from bench import workload
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from bench.stagger import Stagger
from bench.stats import RequestRecord, Summary, summarize
from service.client.grpc_client import CHANNEL_OPTIONS
from service.engine.config import DEFAULT_BUNDLE
from service.settings import ServerSettings

GRPC_PORT = ServerSettings.model_fields["port"].default  # where `attnserve serve` listens unless told


@dataclass
class Level:
    concurrency: int
    summary: Summary
    records: list[RequestRecord]
    client_cpu_s: float  # CPU time of this (client) process during the level

    def to_dict(self) -> dict:
        return {"concurrency": self.concurrency, **self.summary.to_dict(), "client_cpu_s": self.client_cpu_s,
                "ttft_samples_s": [r.ttft for r in self.records if r.ttft is not None],
                "itl_samples_s": [g for r in self.records if r.ok for g in r.itls()]}


def to_request(item: workload.Item, seed: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=item.prompt,
        sampling=pb.SamplingParams(temperature=0.0, seed=seed),
        stopping=pb.StoppingCriteria(max_new_tokens=item.new_tokens, min_new_tokens=item.new_tokens,
                                     ignore_eos=True))


async def drive(address: str, plan: list[list[workload.Item]], timeout_s: float = 600.0,
                stagger: bool = True) -> list[RequestRecord]:
    """Run `plan` (one list of items per client) against `address`; one record per request."""
    clients = len(plan)
    records: list[RequestRecord] = []
    requests = [[to_request(item, seed=c * 1000 + i) for i, item in enumerate(items)] for c, items in enumerate(plan)]
    gate = Stagger(clients, plan[0][0].new_tokens if plan and plan[0] else 0, on=stagger)

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        await channel.channel_ready()

        async def client(c: int) -> None:
            await gate.wait(c)
            for i, (item, request) in enumerate(zip(plan[c], requests[c], strict=True)):
                record = RequestRecord(time.perf_counter(), expected_tokens=item.new_tokens, client=c)
                records.append(record)
                try:
                    async for msg in stub.GenerateStream(request, timeout=timeout_s):
                        n = len(msg.token_ids)
                        record.arrived(time.perf_counter(), n)
                        if msg.HasField("usage"):
                            record.server_ttft = msg.usage.ttft_ms / 1e3
                            record.server_queue = msg.usage.queue_ms / 1e3
                        if c == 0 and i == 0:
                            gate.progressed(n)
                except grpc.aio.AioRpcError as e:
                    record.code = e.code().name
                if c == 0 and i == 0:
                    gate.release()  # never leave a client waiting on a request that failed

        await asyncio.gather(*(client(c) for c in range(clients)))
    return records


async def model_info(address: str) -> pb.ModelInfo:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        return await pb_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)


def make_plan(args, concurrency: int, info: pb.ModelInfo, seed: int) -> list[list[workload.Item]]:
    count = concurrency * args.requests_per_client
    if args.mixed:
        items = workload.mixed(count, info.vocab_size, info.context_tokens, seed)
    else:
        items = workload.fixed(count, args.prompt_tokens, args.new_tokens, info.vocab_size, seed)
    return workload.batches(items, concurrency)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_levels(address: str, args, levels: list[int], progress=print, http_url: str | None = None) -> list[Level]:
    """Each concurrency level in turn against the server at `address` (gRPC), or with `http_url` over HTTP
    (its model facts still read over gRPC from `address`)."""
    info = asyncio.run(model_info(address))
    if http_url:
        from bench.serve_http import HttpLoad

        load = HttpLoad(http_url, model=info.name).drive
    else:
        load = functools.partial(drive, address)
    warm = make_plan(args, 1, info, seed=args.seed + 999)
    asyncio.run(load([warm[0][:1]]))  # connections, code paths and the server's buffers
    out = []
    for c in levels:
        plan = make_plan(args, c, info, seed=args.seed + c)
        cpu = cpu_seconds()
        records = asyncio.run(load(plan, stagger=not args.no_stagger))
        level = Level(c, summarize(records), records, cpu_seconds() - cpu)
        out.append(level)
        progress(line(level))
    return out


def line(level: Level) -> str:
    s = level.summary
    errors = ", ".join(f"{k} {v}" for k, v in s.errors.items()) or "none"
    server = "" if math.isnan(s.server_ttft_s["p50"]) else (  # not reported over HTTP
        f"(server {s.server_ttft_s['p50'] * 1e3:.1f}/{s.server_ttft_s['p99'] * 1e3:.1f}, queue "
        f"{s.server_queue_s['p50'] * 1e3:.1f}/{s.server_queue_s['p99'] * 1e3:.1f})  ")
    return (f"concurrency {level.concurrency:>3}: {s.tokens_per_s:8.0f} tok/s {s.requests_per_s:6.1f} req/s  "
            f"TTFT p50/p99 {s.ttft_s['p50'] * 1e3:6.1f}/{s.ttft_s['p99'] * 1e3:6.1f} ms  {server}"
            f"ITL p50/p99 {s.itl_s['p50'] * 1e3:5.2f}/{s.itl_s['p99'] * 1e3:5.2f} ms  "
            f"e2e p50/p99 {s.e2e_s['p50']:.2f}/{s.e2e_s['p99']:.2f} s  errors: {errors}"
            + (f"  SHORT: {s.short}" if s.short else ""))


def noop_check(args, concurrency: int) -> dict:
    """The client side alone: the same clients against a server that only sends messages."""
    from bench import noop_server
    from service.client.server_process import ServerProcess

    with ServerProcess(command=noop_server.COMMAND, name="noop") as srv:
        levels = run_levels(srv.address, args, [concurrency], progress=lambda s: print("no-op server:", s),
                            http_url=srv.http_url if args.protocol == "http" else None)
    s = levels[0].summary
    return {"concurrency": concurrency, "tokens_per_s": s.tokens_per_s, "client_cpu_s": levels[0].client_cpu_s,
            "tokens": s.tokens, "duration_s": s.duration_s}


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench serve", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", help="a running server: its gRPC host:port, or with --protocol http its HTTP "
                                        "base URL (http://host:port; host:port means http://)")
    where.add_argument("--bundle", type=Path, help=f"start `attnserve serve --bundle` for the run (default "
                                                   f"{DEFAULT_BUNDLE.relative_to(DEFAULT_BUNDLE.parents[1])})")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra `attnserve serve` argument with --bundle (repeat: --server-arg=--threads=2)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                   help="gRPC GenerateStream, or streaming POST /v1/completions (OpenAI's API)")
    p.add_argument("--grpc-server", metavar="HOST:PORT", help=f"with --protocol http and --server: the same "
                   f"server's gRPC address, for the model's facts (default: the --server host, port {GRPC_PORT})")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--mixed", action="store_true", help="prompts of 8-512 and 16-256 new tokens, from --seed")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stagger", action="store_true", help="start every client at once (a burst)")
    p.add_argument("--noop-check", action="store_true", help="measure the client side against a no-op server")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and plots go")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    http = args.protocol == "http"
    if args.grpc_server and not (http and args.server):
        p.error("--grpc-server goes with --protocol http --server URL")

    noop = noop_check(args, max(levels)) if args.noop_check else None
    if args.server:
        address, http_url = http_addresses(args.server, args.grpc_server) if http else (args.server, None)
        results = run_levels(address, args, levels, http_url=http_url)
        graph = asyncio.run(model_info(address)).graph
        server = http_url or args.server
    else:
        from service.client.server_process import ServerProcess

        bundle = args.bundle or DEFAULT_BUNDLE
        serve_args = ["--bundle", str(bundle), "--max-running", str(max(64, max(levels))),
                      *args.server_arg]
        with ServerProcess(serve_args) as srv:
            results = run_levels(srv.address, args, levels, http_url=srv.http_url if http else None)
            graph = asyncio.run(model_info(srv.address)).graph
        server = f"attnserve serve --bundle {bundle.name} {' '.join(args.server_arg)}".strip()

    result = {"machine": describe(), "protocol": args.protocol, "server": server, "graph": graph,
              "workload": "mixed" if args.mixed else "fixed",
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "requests_per_client": args.requests_per_client, "seed": args.seed, "stagger": not args.no_stagger,
              "levels": [level.to_dict() for level in results], "noop": noop}
    md = render(result, argv)
    print(md)
    if not args.no_write:
        from bench import plots

        name = result_name(result)
        publish(name, result, md, args.out)
        plots.serve_plots(result, args.out, name)
    return 0 if all(not level.summary.errors and not level.summary.short for level in results) else 1


def http_addresses(server: str, grpc_server: str | None) -> tuple[str, str]:
    """(gRPC address, HTTP base URL) of the server whose HTTP front is at `server`; the gRPC one, for its
    model facts, is `grpc_server` or the same host on GRPC_PORT."""
    from bench.serve_http import base_url

    url = base_url(server)
    if grpc_server:
        return grpc_server, url
    host = urlsplit(url).hostname
    return f"[{host}]:{GRPC_PORT}" if ":" in host else f"{host}:{GRPC_PORT}", url


def result_name(r: dict) -> str:
    """serve, serve-mixed, serve-http, serve-http-mixed: the JSON, the plots and the BENCHMARKS.md section."""
    return "serve" + ("-http" if r.get("protocol") == "http" else "") + ("-mixed" if r["workload"] == "mixed" else "")


def render(r: dict, argv: list[str] | None) -> str:
    name = result_name(r)
    http = r.get("protocol") == "http"
    cmd = shown("attnserve bench serve" + (" " + " ".join(argv) if argv else ""))
    what = ("mixed: prompts 8–512 tokens, 16–256 new tokens, drawn from seed "
            f"{r['seed']} (clipped to the context)" if r["workload"] == "mixed"
            else f"{r['prompt_tokens']}-token prompts, {r['new_tokens']} new tokens")
    title = "HTTP load (streaming /v1/completions)" if http else "gRPC load"
    lines = [f"## {title} ({r['workload']} workload)", "",
             f"`{cmd}` on {machine_line(r['machine'])}; server: `{r['server']}`, serving graph `{r['graph']}`.", "",
             f"{what}, greedy, ignore_eos; {r['requests_per_client']} requests per client, clients "
             f"{'staggered' if r['stagger'] else 'started at once'}. Throughput over the steady window "
             "(every client busy); latencies over all requests."
             + (" Tokens per request are the usage chunk's; per chunk they are estimated from its text "
                "(`bench/serve_http.py`)." if http else ""), "",
             "| streams | tokens/s | req/s | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p99 | e2e p50 | e2e p99 "
             "| errors | client CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in r["levels"]:
        ms = lambda d, q: f"{d[q] * 1e3:.1f} ms" if not math.isnan(d[q]) else "—"  # noqa: E731
        errors = ", ".join(f"{k} {v}" for k, v in lv["errors"].items()) or "0"
        cpu = lv["client_cpu_s"] / lv["duration_s"] if lv["duration_s"] else math.nan
        lines.append(f"| {lv['concurrency']} | {lv['tokens_per_s']:.0f} | {lv['requests_per_s']:.2f} | "
                     f"{ms(lv['ttft_s'], 'p50')} | {ms(lv['ttft_s'], 'p90')} | {ms(lv['ttft_s'], 'p99')} | "
                     f"{ms(lv['itl_s'], 'p50')} | {ms(lv['itl_s'], 'p99')} | {lv['e2e_s']['p50']:.2f} s | "
                     f"{lv['e2e_s']['p99']:.2f} s | {errors} | {cpu:.0%} of a core |")
    if r["noop"]:
        n = r["noop"]
        top = max(lv["tokens_per_s"] for lv in r["levels"])
        unit = "chunk" if http else "message"
        lines += ["", f"Client-side check: the same clients against a no-op server (`bench.noop_server`, one "
                      f"token per {unit}) took in **{n['tokens_per_s']:.0f} tokens/s** at {n['concurrency']} "
                      f"streams, {n['tokens_per_s'] / top:.1f}× the most the real server produced above."]
    lines += ["", f"![throughput](bench/{name}-throughput.png) ![latency](bench/{name}-latency.png)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
