"""`attnserve bench replicas`: replicas of one model behind the balancers users run, on this machine.

    attnserve bench replicas                           # capacity with 1, 2, 3 replicas; a roll and a kill per path
    attnserve bench replicas --rounds 1 --skip-roll    # the capacity table alone

- **Capacity**: 1, 2 and 3 replicas (`bench.fleet.Fleet`), `--clients` streaming gRPC clients balanced over
  them by the client's round robin, each request `--prompt-tokens` in and `--new-tokens` out. Tokens/s and
  TTFT over a window of steady load (`bench.replicas.capacity`), in `--rounds` rounds with the replica counts
  interleaved; medians reported. Every replica shares this machine's cores: the figures show what
  balancing costs and how evenly it spreads, not how a cluster of machines scales.
- **Rolling update**, per path (gRPC round robin, nginx gRPC, nginx HTTP): the clients stream 32-token requests
  while the three replicas are replaced one at a time; requests sent, completed, retried, lost, TTFT p99
  steady and during the roll.
- **Kill**: SIGKILL one replica under the same load (round robin and nginx gRPC): what its streams ended with,
  and whether every request sent after it died completed.

Writes docs/bench/replicas.json and the replicas section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
from collections import Counter
from pathlib import Path

from attnserve.arguments import HintingParser
from bench.fleet import Fleet
from bench.load_clients import StreamLoad
from bench.machine import RESULTS_DIR, describe, machine_line, publish, shown
from bench.nginx import Nginx
from bench.replicas import PATHS, capacity, kill_under_load, load_on, roll_under_load
from service.engine.config import DEFAULT_BUNDLE


def threads_for(replicas: int) -> int:
    return max(1, (os.cpu_count() or 1) // replicas)


def measure_capacity(args) -> list[dict]:
    runs: dict[int, list[dict]] = {n: [] for n in args.replicas}
    for r in range(args.rounds):
        for n in (args.replicas if r % 2 == 0 else list(reversed(args.replicas))):
            threads = threads_for(n)
            with Fleet(n, args.bundle, ["--threads", str(threads)]) as fleet:
                load = StreamLoad(fleet.grpc_target, round_robin=True, clients=args.clients,
                                  new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens, prefix=f"cap{n}")
                result = asyncio.run(capacity(fleet, load, measured=args.measured))
            runs[n].append({**result, "threads": threads})
            print(f"round {r + 1}: {n} replica(s) x {threads} thread(s): {result['tokens_per_s']:.0f} tok/s, "
                  f"TTFT p99 {1000 * result['ttft_p99_s']:.0f} ms", flush=True)
    rows = []
    for n, rs in runs.items():
        rows.append({"replicas": n, "threads_each": rs[0]["threads"],
                     "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                     "ttft_p50_s": statistics.median(x["ttft_p50_s"] for x in rs),
                     "ttft_p99_s": statistics.median(x["ttft_p99_s"] for x in rs),
                     "least_share": min(min(x["shares"].values()) for x in rs),
                     "most_share": max(max(x["shares"].values()) for x in rs),
                     "errors": sum(sum(x["errors"].values()) for x in rs), "rounds": rs})
    return rows


def roll_and_kill(args) -> tuple[list[dict], list[dict]]:
    rolls, kills = [], []
    with Fleet(3, args.bundle, ["--threads", "1"]) as fleet, Nginx(fleet) as nginx:
        for path in PATHS:
            load = load_on(path, fleet, nginx, clients=args.clients, new_tokens=32, prefix=f"roll-{path}")
            steps = asyncio.run(roll_under_load(fleet, load))
            s = load.summary(fleet.refusals() | nginx.resent())
            rolls.append({"path": path, **s.to_dict(), "steps": steps})
            print(f"roll over {path}: {s.sent} sent, {s.completed} completed, {s.retried} retried, {s.lost} lost",
                  flush=True)
        for path in PATHS[:2]:
            victim = fleet.replicas[1]
            load = load_on(path, fleet, nginx, clients=args.clients, new_tokens=64, prefix=f"kill-{path}",
                            deadline_s=60.0)
            killed_at = asyncio.run(kill_under_load(load, victim))
            victim.start()
            failed = [o for o in load.outcomes if o.code != "OK"]
            later = [o for o in load.outcomes if o.sent > killed_at]
            kills.append({"path": path, "failed": dict(Counter(o.code for o in failed)),
                          "failed_with_tokens": dict(Counter(o.code for o in failed if o.first_token is not None)),
                          "failed_end_after_kill_s_max": max((o.ended - killed_at for o in failed), default=None),
                          "sent_after": len(later), "completed_after": sum(1 for o in later if o.code == "OK")})
            print(f"kill over {path}: {kills[-1]}", flush=True)
    return rolls, kills


def markdown(r: dict) -> str:
    a = r["args"]
    command = shown(" ".join(["attnserve bench replicas", *r["argv"]]))
    lines = ["## Replicas behind a balancer", "",
             f"`{command}` on {machine_line(r['machine'])}; `{Path(a['bundle']).name}`, replicas started as "
             f"`attnserve serve --threads N`. **All replicas share this machine's 2 cores**: the table shows what "
             "balancing costs and how evenly it spreads the calls, not how replicas on separate machines add up.",
             "", f"Capacity: {a['clients']} streaming gRPC clients, round robin over every replica, "
             f"{a['prompt_tokens']}-token prompts, {a['new_tokens']} new tokens each; medians of {a['rounds']} "
             "rounds, replica counts interleaved.", "",
             "| replicas | threads each | generated tok/s | TTFT p50 | TTFT p99 | share of calls (least–most) "
             "| errors |",
             "|---|---|---|---|---|---|---|"]
    for row in r["capacity"]:
        lines.append(f"| {row['replicas']} | {row['threads_each']} | {row['tokens_per_s']:.0f} | "
                     f"{1000 * row['ttft_p50_s']:.0f} ms | {1000 * row['ttft_p99_s']:.0f} ms | "
                     f"{row['least_share']:.3f}–{row['most_share']:.3f} | {row['errors']} |")
    if r.get("rolls"):
        lines += ["", f"Rolling update: {a['clients']} clients stream 32-token requests while the 3 replicas are "
                  "replaced one at a time (SIGTERM, wait for the exit, start again on the same ports, wait for "
                  "SERVING). *Retried*: refused by a replica, or sent to a second one by nginx, then completed.", "",
                  "| path | sent | completed | retried | lost | TTFT p99 steady | TTFT p99 during the roll |",
                  "|---|---|---|---|---|---|---|"]
        for x in r["rolls"]:
            lines.append(f"| {x['path']} | {x['sent']} | {x['completed']} | {x['retried']} | {x['lost']} | "
                         f"{1000 * x['ttft_p99_s']['steady']:.0f} ms | {1000 * x['ttft_p99_s']['roll']:.0f} ms |")
        lines += ["", "SIGKILL of one replica under the same load (64-token requests):", "",
                  "| path | its requests ended with | of which had tokens | ended within (after the kill) | "
                  "requests sent after | completed |", "|---|---|---|---|---|---|"]
        for k in r["kills"]:
            within = k["failed_end_after_kill_s_max"]
            lines.append(f"| {k['path']} | {', '.join(f'{n} {c}' for c, n in k['failed'].items())} | "
                         f"{', '.join(f'{n} {c}' for c, n in k['failed_with_tokens'].items())} | "
                         f"{'' if within is None else f'{1000 * within:.0f} ms'} | {k['sent_after']} | "
                         f"{k['completed_after']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)  # the command is recorded with its arguments
    p = HintingParser(prog="attnserve bench replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default=str(DEFAULT_BUNDLE))
    p.add_argument("--replicas", default="1,2,3", help="replica counts for the capacity table")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--measured", type=int, default=12, help="requests per client in the measured window (a multiple of "
                   "every replica count: each channel's round robin then gives each replica the same number)")
    p.add_argument("--skip-roll", action="store_true", help="the capacity table alone")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    args.replicas = [int(x) for x in args.replicas.split(",")]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"machine": describe(), "argv": argv, "args": settings, "capacity": measure_capacity(args)}
    if not args.skip_roll:
        result["rolls"], result["kills"] = roll_and_kill(args)
    text = markdown(result)
    print(text)
    publish("replicas", result, text, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
