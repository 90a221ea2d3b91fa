"""`attnserve bench soak`: a mixed load for a long time, watching memory, throughput and errors.

    attnserve bench soak [--minutes 10] [--concurrency 16] [--bundle models/shakespeare-onnx]
    attnserve bench soak --server HOST:PORT --pid PID       # watch a running server instead
    attnserve bench soak --minutes 0.1 --interval 1 --concurrency 2 --no-write   # a few seconds, to try it

It starts `attnserve serve` (or watches a running server whose process id is given), then keeps
`--concurrency` streaming clients busy with the mixed workload (prompts of 8-512 tokens, 16-256
new tokens, seeded, clipped to the context) until the time is up. Every `--interval` seconds it
records the server's resident memory (VmRSS), the tokens and requests completed since the last
sample, and errors by status code. A leak shows as RSS that keeps climbing after warm-up; the
target is flat within ±10% of its median after the first minute, and no errors at all.

Writes docs/bench/soak.json, docs/bench/soak.png (or both into --out) and the soak section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from pathlib import Path

import grpc

from attnserve.arguments import HintingParser
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from bench import workload
from bench.commands.serve import DEFAULT_BUNDLE, model_info, to_request
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from service.client.grpc_client import CHANNEL_OPTIONS

WARM_UP_S = 60.0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def soak(address: str, pid: int, seconds: float, concurrency: int, interval: float, seed: int) -> dict:
    info = await model_info(address)
    counts = Counter()  # tokens and requests since the last sample, and errors by code in all
    errors: Counter[str] = Counter()
    samples = []
    start = time.monotonic()
    end = start + seconds

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.TextGenerationStub(channel)

        async def client(c: int) -> None:
            i = 0
            while time.monotonic() < end:
                item = workload.mixed(1, info.vocab_size, info.context_tokens, seed=seed * 100_003 + c * 10_007 + i)[0]
                i += 1
                try:
                    async for msg in stub.GenerateStream(to_request(item, seed=i), timeout=120):
                        counts["tokens"] += len(msg.token_ids)
                    counts["requests"] += 1
                except grpc.aio.AioRpcError as e:
                    errors[e.code().name] += 1

        async def sampler() -> None:
            last = time.monotonic()
            while time.monotonic() < end:
                await asyncio.sleep(interval)
                now = time.monotonic()
                samples.append({"t": now - start, "rss": rss_bytes(pid),
                                "tokens_per_s": counts["tokens"] / (now - last),
                                "requests_per_s": counts["requests"] / (now - last),
                                "errors": sum(errors.values())})
                print(f"t={now - start:6.0f}s  rss {samples[-1]['rss'] / 2**20:7.1f} MiB  "
                      f"{samples[-1]['tokens_per_s']:7.0f} tok/s  errors {dict(errors) or 0}", flush=True)
                counts.clear()
                last = now

        await asyncio.gather(sampler(), *(client(c) for c in range(concurrency)))
    return {"graph": info.graph, "samples": samples, "errors": dict(errors)}


def verdict(samples: list[dict], errors: dict) -> dict:
    steady = [s["rss"] for s in samples if s["t"] > WARM_UP_S] or [s["rss"] for s in samples]
    median = statistics.median(steady)
    spread = max(abs(max(steady) - median), abs(min(steady) - median)) / median
    rates = [s["tokens_per_s"] for s in samples if s["t"] > WARM_UP_S] or [s["tokens_per_s"] for s in samples]
    return {"rss_median_bytes": median, "rss_max_deviation": spread, "rss_flat": spread <= 0.10,
            "rss_first_bytes": samples[0]["rss"], "rss_last_bytes": samples[-1]["rss"],
            "tokens_per_s_median": statistics.median(rates), "tokens_per_s_min": min(rates),
            "tokens_per_s_max": max(rates), "errors": sum(errors.values()), "no_errors": not errors}


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in result["samples"]]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a.plot(t, [s["rss"] / 2**20 for s in result["samples"]], "-", color="tab:blue")
    median = result["verdict"]["rss_median_bytes"] / 2**20
    a.axhspan(median * 0.9, median * 1.1, color="tab:green", alpha=0.15, label="median ±10% (after the first minute)")
    a.set_ylabel("server RSS (MiB)")
    a.legend(loc="lower right")
    a.grid(alpha=0.3)
    b.plot(t, [s["tokens_per_s"] for s in result["samples"]], "-", color="tab:orange")
    b.set_ylabel("generated tokens/s")
    b.set_xlabel("minutes")
    b.grid(alpha=0.3)
    errors = result["verdict"]["errors"]
    fig.suptitle(f"Soak: {result['concurrency']} streams, mixed workload, {errors} error{'s' if errors != 1 else ''}")
    fig.tight_layout()
    path = out / "soak.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bundle", type=Path, default=None,
                   help=f"start a server on this bundle (default {DEFAULT_BUNDLE.name})")
    p.add_argument("--server", help="a running server instead (needs --pid, to read its memory)")
    p.add_argument("--pid", type=int, help="process id of --server")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and the plot go")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    if args.server and not args.pid:
        p.error("--server needs --pid (the soak reads the server's memory from /proc)")
    seconds = args.minutes * 60
    if seconds < args.interval:
        p.error(f"--minutes {args.minutes:g} is shorter than one --interval ({args.interval:g} s): no sample")
    if args.server:
        raw = asyncio.run(soak(args.server, args.pid, seconds, args.concurrency, args.interval, args.seed))
        server = args.server
    else:
        from service.client.server_process import ServerProcess

        bundle = args.bundle or DEFAULT_BUNDLE
        with ServerProcess(["--bundle", str(bundle)]) as srv:
            raw = asyncio.run(soak(srv.address, srv.pid, seconds, args.concurrency, args.interval, args.seed))
        server = f"attnserve serve --bundle {bundle.name}"
    result = {"machine": describe(), "server": server, "minutes": args.minutes, "concurrency": args.concurrency,
              "interval_s": args.interval, "seed": args.seed, **raw, "verdict": verdict(raw["samples"], raw["errors"])}
    md = render(result, argv)
    print(md)
    if not args.no_write:
        publish("soak", result, md, args.out)
        plot(result, args.out)
    v = result["verdict"]
    return 0 if v["rss_flat"] and v["no_errors"] else 1


def render(r: dict, argv: list[str] | None) -> str:
    v = r["verdict"]
    cmd = shown("attnserve bench soak" + (" " + " ".join(argv) if argv else ""))
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    return "\n".join([
        "## Soak", "",
        f"`{cmd}` on {machine_line(r['machine'])}; server: `{r['server']}`, serving graph `{r['graph']}`.", "",
        f"{r['concurrency']} streaming clients on the mixed workload (prompts 8–512 tokens, 16–256 new tokens, "
        f"seeded, clipped to the context) for {r['minutes']:g} minutes; the server's RSS and the throughput "
        f"sampled every {r['interval_s']:g} s.", "",
        "| | measured | target | |", "|---|---|---|---|",
        f"| server RSS after the first minute | median {mib(v['rss_median_bytes'])}, largest deviation "
        f"{v['rss_max_deviation']:.1%} (first sample {mib(v['rss_first_bytes'])}, last {mib(v['rss_last_bytes'])}) "
        f"| within ±10% | {'met' if v['rss_flat'] else '**missed**'} |",
        f"| errors | {v['errors']} {r['errors'] or ''} | 0 | {'met' if v['no_errors'] else '**missed**'} |",
        f"| tokens/s after the first minute | median {v['tokens_per_s_median']:.0f} (min {v['tokens_per_s_min']:.0f}, "
        f"max {v['tokens_per_s_max']:.0f}) | steady | |",
        "", "![soak: RSS and throughput over time](bench/soak.png)"]) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
