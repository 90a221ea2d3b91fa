"""`attnserve bench priority`: what request priority buys interactive requests beside a batch job, over gRPC.

    attnserve bench priority                                   # the shipped default model
    attnserve bench priority --bundle runs/bundle --quick --no-write        # seconds

`attnserve serve` runs the bundle in a child process with --max-running streams. Interactive requests (a
short prompt, a few tokens, priority 0) are sent one at a time, one every --interval-s whether or not the
previous one has ended (arrivals at a fixed rate, as users send them), and each one's time to first token
is taken as the client sees it, in three cases:
1. alone: nothing else runs; --interactive requests;
2. amid a batch job at priority 10: --batch-requests long requests (random prompts, --batch-tokens tokens
   each, EOS ignored) submitted at once before the first interactive one, so the server queues most of
   them; an interactive request waits for a running one to free a slot, not for the queue (nothing is
   preempted);
3. amid the same batch job at priority 0: an interactive request queues behind the batch, in arrival order.
In the batch cases the interactive requests start once the server reports the batch's requests waiting,
and are sent while the batch runs (the first always; at most --interactive). Each case reports the
interactive TTFT p50 and p99 and how many were sent, and the batch's throughput (its tokens over the time
from its submission to its last request's end). Writes docs/bench/priority.json (or into --out) and the
priority section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from attnserve.arguments import HintingParser
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from bench.peers.protocol import percentile
from service.client import AsyncClient
from service.client.server_process import ServerProcess
from service.engine.config import DEFAULT_BUNDLE

DEFAULTS = dict(max_running=8, interactive=100, interval_s=0.25, interactive_prompt_tokens=8, interactive_tokens=8,
                batch_requests=512, batch_prompt_tokens=32, batch_tokens=192, batch_priority=10)
QUICK = dict(max_running=2, interactive=4, interval_s=0.1, interactive_prompt_tokens=4, interactive_tokens=2,
             batch_requests=8, batch_prompt_tokens=4, batch_tokens=12)
QUEUE_WAIT_S = 60.0  # the batch's requests must be queued within this long


async def first_token(client: AsyncClient, prompt: list[int], tokens: int) -> float:
    """Seconds from sending an interactive request to its first streamed token; the stream is read to its end."""
    started = time.perf_counter()
    ttft = None
    async for msg in client.stream_responses(prompt, max_new_tokens=tokens, temperature=0.0, ignore_eos=True,
                                             priority=0):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - started
    assert ttft is not None, "the stream ended without a token"
    return ttft


async def queued(client: AsyncClient, batch: list[asyncio.Task]) -> None:
    """Until the server reports requests waiting (the batch fills its queue), or the batch is over."""
    deadline = time.monotonic() + QUEUE_WAIT_S
    while not all(t.done() for t in batch):
        if (await client.server_info()).requests_waiting > 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the batch's requests were not queued within {QUEUE_WAIT_S:.0f} s")
        await asyncio.sleep(0.01)


async def run_case(client: AsyncClient, args, rng: np.random.Generator, vocab: int, batch_priority: int | None
                   ) -> dict:
    """One case: the interactive arrivals, amid a batch at `batch_priority` (None: alone)."""
    started = time.perf_counter()
    batch = [asyncio.create_task(client.generate(rng.integers(1, vocab, args.batch_prompt_tokens).tolist(),
                                                 max_new_tokens=args.batch_tokens, temperature=0.0, ignore_eos=True,
                                                 priority=batch_priority))
             for _ in range(args.batch_requests if batch_priority is not None else 0)]
    await queued(client, batch)
    first = time.perf_counter()
    interactive = []
    for i in range(args.interactive):
        await asyncio.sleep(max(0.0, first + i * args.interval_s - time.perf_counter()))
        if i and batch and all(t.done() for t in batch):
            break  # the batch is over: what follows would be the alone case again
        prompt = rng.integers(1, vocab, args.interactive_prompt_tokens).tolist()
        interactive.append(asyncio.create_task(first_token(client, prompt, args.interactive_tokens)))
    ttfts = list(await asyncio.gather(*interactive))
    done = await asyncio.gather(*batch)
    batch_s = time.perf_counter() - started if batch else 0.0
    tokens = sum(r.usage.completion_tokens for r in done)
    return {"batch_priority": batch_priority, "ttft_s": ttfts, "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99), "batch_tokens": tokens, "batch_s": batch_s,
            "batch_tokens_per_s": tokens / batch_s if batch else None}


async def measure(address: str, args) -> dict:
    rng = np.random.default_rng(args.seed)
    async with AsyncClient(address, timeout_s=3600) as client:
        info = await client.model_info()
        if args.batch_prompt_tokens + args.batch_tokens > info.context_tokens:
            raise SystemExit(f"a batch request of {args.batch_prompt_tokens} + {args.batch_tokens} tokens does not "
                             f"fit the model's context of {info.context_tokens}")
        await first_token(client, rng.integers(1, info.vocab_size, args.interactive_prompt_tokens).tolist(), 1)
        cases = {}
        for name, priority in (("alone", None), (f"batch at priority {args.batch_priority}", args.batch_priority),
                               ("batch at priority 0", 0)):
            cases[name] = await run_case(client, args, rng, info.vocab_size, priority)
            c = cases[name]
            print(f"{name}: {len(c['ttft_s'])} interactive requests, TTFT p50 {c['ttft_p50_s'] * 1e3:.1f} ms, "
                  f"p99 {c['ttft_p99_s'] * 1e3:.1f} ms"
                  + (f"; batch {c['batch_tokens_per_s']:.0f} tokens/s" if c["batch_tokens"] else ""), flush=True)
    return {"model": info.name, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench priority", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    for name, default in DEFAULTS.items():
        quick = f" ({QUICK[name]} with --quick)" if name in QUICK else ""
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), help=f"default {default}{quick}")
    p.add_argument("--quick", action="store_true", help="a small run, in seconds, to check the command works")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = p.parse_args(argv)
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK.get(name, default) if args.quick else default)
    if args.batch_priority <= 0:
        p.error("--batch-priority must be above 0, the interactive requests' priority")
    serve = ["--bundle", str(args.bundle), "--max-running", str(args.max_running),
             "--max-waiting", str(args.batch_requests + args.interactive)]  # every request may wait at once
    with ServerProcess(serve) as server:
        measured = asyncio.run(measure(server.address, args))
    result = {"machine": describe(), "command": "attnserve bench priority" + (" " + " ".join(argv) if argv else ""),
              "settings": {name: getattr(args, name) for name in DEFAULTS}, **measured}
    md = render(result)
    print(md)
    if not args.no_write:
        publish("priority", result, md, args.out)
    return 0


def render(r: dict) -> str:
    s = r["settings"]
    lines = ["## Priority: interactive requests beside a batch job", "",
             f"`{shown(r['command'])}` on {machine_line(r['machine'])}.", "",
             f"`{r['model']}` over gRPC, `--max-running {s['max_running']}`. Interactive requests "
             f"({s['interactive_prompt_tokens']}-token prompts, {s['interactive_tokens']} tokens, priority 0) arrive "
             f"one every {s['interval_s']:g} s, alone and while a batch job of {s['batch_requests']} requests "
             f"({s['batch_prompt_tokens']}-token prompts, {s['batch_tokens']} tokens each, submitted at once) runs. "
             "A running request is never preempted: an urgent one waits for a slot, not for the queue.", "",
             "| case | interactive requests | TTFT p50 (ms) | TTFT p99 (ms) | batch tokens/s |",
             "|---|---|---|---|---|"]
    for name, c in r["cases"].items():
        rate = f"{c['batch_tokens_per_s']:.0f}" if c["batch_tokens_per_s"] is not None else "—"
        lines.append(f"| {name} | {len(c['ttft_s'])} | {c['ttft_p50_s'] * 1e3:.1f} | {c['ttft_p99_s'] * 1e3:.1f} | "
                     f"{rate} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
