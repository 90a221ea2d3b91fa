"""attnserve on an encoder-decoder bundle, measured for `attnserve bench g2p` (the spec and result of
`seq2seq_peer.py`), in-process or over gRPC, in a process of its own.

    python -m bench.peers.seq2seq_attnserve --bundle B --mode in-process --graph static --spec spec.json
    python -m bench.peers.seq2seq_attnserve --bundle B --mode grpc --graph static-int8 --spec spec.json

Settings: `max_running` = C (the concurrency), room for C sources in one prefill, onnxruntime threads =
one per core. Greedy (temperature 0), to EOS or N tokens. In-process: the `Engine` stepped directly;
alone is one request at a time, concurrent is every source added at once, C decoded together and the
next admitted as one finishes (continuous batching). Over gRPC: unary `Generate` calls on one
channel, alone one after another, concurrent with C in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from bench.peers.protocol import emit, peak_rss_bytes


def limits(spec: dict) -> dict:
    c = spec["concurrency"] * spec.get("beam", 1)  # a beam search runs a sequence per beam
    longest = max(map(len, spec["sources"]))
    return {"max_running": c, "max_batch_tokens": max(512, c * (longest + 1))}


def engine_run(engine, sources: list[list[int]], max_new: int, beam: int = 1) -> list[list[int]]:
    from service.engine.request import BeamParams, GenerationRequest, SamplingParams, StoppingCriteria

    done = engine.generate([GenerationRequest(f"s{i}", list(src), SamplingParams(temperature=0.0),
                                              StoppingCriteria(max_new_tokens=max_new),
                                              beam=BeamParams(beam) if beam > 1 else None)
                            for i, src in enumerate(sources)])
    for result in done:
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
    return [result.token_ids() for result in done]


def in_process(bundle: Path, graph: str, spec: dict) -> tuple[dict, dict]:
    from service.engine.config import EngineConfig
    from service.engine.core import Engine

    lim = limits(spec)
    engine = Engine(EngineConfig(bundle=bundle, graph=graph, **lim))
    engine.warm_up()
    eos = engine.model.eos_token_id

    def run(sources: list[list[int]], batch: int) -> list[list[int]]:
        beam = spec.get("beam", 1)
        if batch == 1:
            return [engine_run(engine, [s], spec["max_new"], beam)[0] for s in sources]
        return engine_run(engine, sources, spec["max_new"], beam)

    async def run_async(sources: list[list[int]], batch: int) -> list[list[int]]:
        return run(sources, batch)

    result = asyncio.run(measure_async(run_async, spec))
    result["outputs"] = [[t for t in row if t != eos] for row in result["outputs"]]
    return result, {**lim, "graph": graph, "api": "Engine.step; concurrent: every source added at once"}


def over_grpc(bundle: Path, graph: str, spec: dict) -> tuple[dict, dict]:
    from service.client.server_process import ServerProcess

    lim = limits(spec)
    args = ["--bundle", str(bundle), "--graph", graph, "--max-running", str(lim["max_running"]),
            "--max-batch-tokens", str(lim["max_batch_tokens"])]
    with ServerProcess(args) as srv:
        result = asyncio.run(grpc_measure(srv.address, spec))
        rss = peak_rss_bytes(srv.pid)
    return {**result, "peak_rss_bytes": rss}, {**lim, "api": "gRPC Generate (unary), C in flight",
                                               "server": "attnserve serve " + " ".join(args)}


async def grpc_measure(address: str, spec: dict) -> dict:
    import grpc

    from attnserve.v1 import generate_pb2 as pb
    from attnserve.v1 import generate_pb2_grpc as pb_grpc
    from service.client.grpc_client import CHANNEL_OPTIONS

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        await channel.channel_ready()

        async def one(src: list[int]) -> list[int]:
            beam = spec.get("beam", 1)
            reply = await stub.Generate(pb.GenerateRequest(
                prompt_token_ids=src, sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_new_tokens=spec["max_new"]), beam_width=beam if beam > 1 else 0),
                timeout=600)
            ids = list(reply.completions[0].token_ids)
            return ids[:-1] if reply.completions[0].finish_reason == pb.FINISH_REASON_EOS_TOKEN else ids

        async def run(sources: list[list[int]], batch: int) -> list[list[int]]:
            if batch == 1:
                return [await one(s) for s in sources]
            gate = asyncio.Semaphore(batch)

            async def gated(src):
                async with gate:
                    return await one(src)

            return list(await asyncio.gather(*(gated(s) for s in sources)))

        return await measure_async(run, spec)


async def measure_async(run, spec: dict) -> dict:
    """The outputs of every source (concurrently, untimed: the warm-up), then per repeat the first K alone
    and all of them C at a time, timed."""
    k, c = spec["alone"], spec["concurrency"]
    outputs = await run(spec["sources"], c)
    alone, concurrent = [], []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        await run(spec["sources"][:k], 1)
        alone.append(k / (time.perf_counter() - start))
        start = time.perf_counter()
        await run(spec["sources"], c)
        concurrent.append(len(spec["sources"]) / (time.perf_counter() - start))
    return {"alone_words_per_s": alone, "concurrent_words_per_s": concurrent, "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    from importlib.metadata import version

    import onnxruntime

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--mode", choices=("in-process", "grpc"), required=True)
    p.add_argument("--graph", default="static", help="the bundle's graph to serve: static (fp32) or static-int8")
    p.add_argument("--spec", required=True)
    args = p.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    result, settings = (in_process if args.mode == "in-process" else over_grpc)(args.bundle, args.graph, spec)
    result.setdefault("peak_rss_bytes", peak_rss_bytes())
    system = "attnserve in-process" if args.mode == "in-process" else "attnserve gRPC"
    precision = "int8" if args.graph.endswith("int8") else "fp32"
    emit({"system": f"{system} {precision}", "precision": precision, "settings": settings,
          "versions": {"attnserve": version("attnserve"), "onnxruntime": onnxruntime.__version__}, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
