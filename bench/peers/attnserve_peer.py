"""attnserve measured by the peer protocol, in-process or over gRPC, each in a process of its own.

    python -m bench.peers.attnserve_peer --bundle B --graph static-int8 --mode in-process --spec spec.json
    python -m bench.peers.attnserve_peer --bundle B --graph static --mode grpc --spec spec.json

`bench.commands.compare` runs this in a child process per system and round, so that every system's peak RSS
is its own: in-process, the VmHWM of this process (the engine and the bundle it loaded); over gRPC,
the VmHWM of the `attnserve serve` child (`service.client.server_process.ServerProcess`), read before it stops.

**Settings.** The graph is pinned (`--graph`), `max_running` = the 32 streams, `max_batch_tokens` =
room for all 32 prompts in one prefill, `max_context` = the longest prompt plus the new tokens (each
KV slot holds that many positions, as each llama.cpp slot holds its share of `-c`), onnxruntime
threads = one per core (the default), prefix caching off (the rounds repeat the same prompts;
llama.cpp runs with `cache_prompt: false` likewise), and `allow_low_agreement` on: the random weights
of the real sizes are benchmarked for speed, and a reduced-precision graph of them may miss the
self-check's agreement bar (the table's greedy agreement columns say how far it is from fp32).
Greedy: temperature 0, `ignore_eos`, `min_new_tokens = max_new_tokens = N`.

**What is timed.** In-process: the `Engine` stepped directly (no front, no event loop); batch 1 is one
request at a time, the streams are 32 requests added at once; a sequence's first token is timed when
`step(emit=...)` hands it out (right after its prefill, before the decode rows run). Over gRPC: one
`GenerateStream` per sequence on one channel, batch 1 one after another and the 32 streams at once
(no stagger); TTFT = send → the first message with a token. The `tokens` are the 32 streams' ids as
the untimed warm-up round received them; the `single_tokens` are the ids of the first batch-1 repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from bench.peers.protocol import Recorder, emit, peak_rss_bytes, read_spec
from bench.peers.systems import GRAPHS

GRAPH_PRECISION = {graph: precision for precision, graph in GRAPHS.items()}
MODES = ("in-process", "grpc")


def limits(spec: dict) -> dict:
    """max_running, max_batch_tokens and max_context: all streams at once, all their prompts in one
    prefill, and slots as long as the longest prompt plus its new tokens."""
    streams = len(spec["streams"])
    prompt = max(len(p) for p in spec["streams"] + spec["single"])
    return {"max_running": streams, "max_batch_tokens": max(512, streams * (prompt + 1)),
            "max_context": prompt + spec["new_tokens"]}


def serve_args(bundle: Path, graph: str, lim: dict) -> list[str]:
    """`attnserve serve`'s flags: the graph pinned, prefix caching off and the `limits`."""
    return ["--bundle", str(bundle), "--graph", graph, "--no-prefix-caching", "--allow-low-agreement",
            "--max-running", str(lim["max_running"]), "--max-batch-tokens", str(lim["max_batch_tokens"]),
            "--max-context", str(lim["max_context"])]


# ---- in-process -----------------------------------------------------------------------------------


def engine_run(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[list[list[int]], float, list]:
    """All `prompts` added at once, stepped to the end: (ids per prompt, seconds, each one's TTFT)."""
    from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria

    ids = {f"{tag}-{i}": [] for i in range(len(prompts))}
    first: dict[str, float] = {}
    start = time.perf_counter()

    def take(outputs) -> None:
        now = time.perf_counter()
        for state, item in outputs:
            if not hasattr(item, "token_id"):
                raise RuntimeError(f"request {state.id} failed: {item}")
            first.setdefault(state.id, now - start)
            ids[state.id].append(item.token_id)

    engine.generate([GenerationRequest(rid, list(prompt), SamplingParams(temperature=0.0),
                                       StoppingCriteria(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                        ignore_eos=True))
                     for rid, prompt in zip(ids, prompts, strict=True)], on_outputs=take)
    elapsed = time.perf_counter() - start
    return list(ids.values()), elapsed, [first[rid] for rid in ids]


def in_process(bundle: Path, graph: str, spec: dict) -> tuple[Recorder, list[list[int]], dict, int]:
    from service.engine.config import EngineConfig
    from service.engine.core import Engine

    lim = limits(spec)
    engine = Engine(EngineConfig(bundle=bundle, graph=graph, prefix_caching=False, allow_low_agreement=True, **lim))
    engine.warm_up()
    new = spec["new_tokens"]
    rec = Recorder(spec)
    tokens, _, _ = engine_run(engine, spec["streams"], new, "warm")
    for r in range(spec["repeats"]):
        times, ttfts, alone = [], [], []
        for i, prompt in enumerate(spec["single"]):
            ids, seconds, first = engine_run(engine, [prompt], new, f"b1-{r}-{i}")
            times.append(seconds)
            ttfts.append(first[0])
            alone.append(ids[0])
        rec.add_single(times, ttfts, alone)
        _, seconds, firsts = engine_run(engine, spec["streams"], new, f"streams-{r}")
        rec.add_streams(seconds, firsts)
    settings = {"graph": engine.runner.graph_name, "threads": "onnxruntime default (one per core)",
                "prefix_caching": False, "allow_low_agreement": True, **lim,
                "api": "Engine.step, requests added at once"}
    return rec, tokens, settings, peak_rss_bytes()


# ---- over gRPC ------------------------------------------------------------------------------------


async def grpc_run(stub, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, list[float]]:
    """One GenerateStream per prompt, all at once: (ids per prompt, seconds, each one's TTFT)."""
    from bench import workload
    from bench.commands.serve import to_request

    start = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> tuple[list[int], float]:
        ids, first = [], None
        async for msg in stub.GenerateStream(to_request(workload.Item(list(prompt), new_tokens), seed=i),
                                             timeout=600):
            if msg.token_ids and first is None:
                first = time.perf_counter() - start
            ids += msg.token_ids
        return ids, first

    done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    return [ids for ids, _ in done], elapsed, [first for _, first in done]


async def grpc_rounds(address: str, spec: dict) -> tuple[Recorder, list[list[int]]]:
    import grpc

    from attnserve.v1 import generate_pb2_grpc as pb_grpc
    from service.client.grpc_client import CHANNEL_OPTIONS

    new = spec["new_tokens"]
    rec = Recorder(spec)
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        await channel.channel_ready()
        tokens, _, _ = await grpc_run(stub, spec["streams"], new)
        for _ in range(spec["repeats"]):
            times, ttfts, alone = [], [], []
            for prompt in spec["single"]:
                ids, seconds, first = await grpc_run(stub, [prompt], new)
                times.append(seconds)
                ttfts.append(first[0])
                alone.append(ids[0])
            rec.add_single(times, ttfts, alone)
            _, seconds, firsts = await grpc_run(stub, spec["streams"], new)
            rec.add_streams(seconds, firsts)
    return rec, tokens


def over_grpc(bundle: Path, graph: str, spec: dict) -> tuple[Recorder, list[list[int]], dict, int]:
    from service.client.server_process import ServerProcess

    lim = limits(spec)
    args = serve_args(bundle, graph, lim)
    with ServerProcess(args) as srv:
        rec, tokens = asyncio.run(grpc_rounds(srv.address, spec))
        rss = peak_rss_bytes(srv.pid)
    settings = {"graph": graph, "threads": "onnxruntime default (one per core)", "prefix_caching": False, **lim,
                "api": "gRPC GenerateStream, one stream per sequence, no stagger",
                "server": "attnserve serve " + " ".join(args) + " (stream settings at their defaults)"}
    return rec, tokens, settings, rss


def versions() -> dict:
    from importlib.metadata import version

    import onnxruntime

    return {"attnserve": version("attnserve"), "onnxruntime": onnxruntime.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--graph", choices=sorted(GRAPH_PRECISION), required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--spec", required=True)
    args = p.parse_args(argv)
    spec = read_spec(args.spec)
    run = in_process if args.mode == "in-process" else over_grpc
    rec, tokens, settings, rss = run(args.bundle, args.graph, spec)
    system = "attnserve in-process" if args.mode == "in-process" else "attnserve gRPC"
    emit(rec.result(system, GRAPH_PRECISION[args.graph], settings, versions(), tokens, rss))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
