"""A TextGeneration server that generates nothing: it answers a stream with `max_new_tokens`
one-token messages as fast as gRPC sends them. It measures the load generator, not a model.
With `--http-port`, it also answers a streaming `POST /v1/completions` with `max_tokens` one-token
chunks, the usage chunk and `[DONE]`, in the HTTP front's shapes (and `/health`, `/v1/models`).

    python -m bench.noop_server --port 50052 [--http-port 8001]

`attnserve bench serve --noop-check` runs it in a child process (`ServerProcess(command=COMMAND)`: it takes
`attnserve serve`'s host and port flags) and drives it with the same client code and concurrency as the real
run: the tokens per second it reaches is a lower bound on what the client side can take in (the no-op
server shares the machine with it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc

VOCAB = 4096
CONTEXT = 1 << 20
COMMAND = (sys.executable, "-m", "bench.noop_server")  # for ServerProcess


class NoopGeneration(pb_grpc.TextGenerationServicer):
    async def GenerateStream(self, request, context):  # noqa: N802 (gRPC method name)
        n = request.stopping.max_new_tokens or 16
        last = n - 1
        for i in range(n):
            if i == last:
                yield pb.GenerateStreamResponse(request_id=request.request_id, token_ids=[i % VOCAB], text="x",
                                                finish_reason=pb.FINISH_REASON_LENGTH,
                                                usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                               completion_tokens=n))
            else:
                yield pb.GenerateStreamResponse(request_id=request.request_id, token_ids=[i % VOCAB], text="x")

    async def GetModelInfo(self, request, context):  # noqa: N802
        return pb.ModelInfo(name="noop", vocab_size=VOCAB, context_tokens=CONTEXT, eos_token_id=0)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(choices: list[dict], usage: dict | None = None) -> bytes:
    return _sse({"id": "cmpl-noop", "object": "text_completion", "created": 0, "model": "noop", "choices": choices,
                 "usage": usage})


TOKEN_CHUNK = _chunk([{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}])
LAST_CHUNK = _chunk([{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}])


async def completions(request: Request) -> StreamingResponse:
    body = await request.json()
    n = body.get("max_tokens") or 16
    prompt_tokens = len(body.get("prompt") or [])
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

    async def chunks():
        for _ in range(n - 1):
            yield TOKEN_CHUNK
        yield LAST_CHUNK
        yield _chunk([], usage)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": "noop", "object": "model", "max_model_len": CONTEXT}]})


async def health_check(request: Request) -> JSONResponse:
    return JSONResponse({"status": "serving"})


def http_app() -> Starlette:
    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/health", health_check, methods=["GET"])])


async def serve(port: int, http_port: int = 0, host: str = "127.0.0.1") -> None:
    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServicer_to_server(NoopGeneration(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    if http_port:
        # uvicorn takes SIGTERM, stops, then raises it again: the process ends as it would without uvicorn
        http = uvicorn.Server(uvicorn.Config(http_app(), host=host, port=http_port, lifespan="off",
                                             log_level="warning", access_log=False))
        task = asyncio.create_task(http.serve())
        while not http.started:  # SERVING only once both ports accept
            if task.done():
                task.result()
                raise RuntimeError("the HTTP port stopped while starting")
            await asyncio.sleep(0.01)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.noop_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address both ports bind to")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--http-port", type=int, default=0, help="also serve /v1/completions here (0 = no HTTP)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="taken as `attnserve serve` takes it; no metrics are served")
    args = p.parse_args(argv)
    try:
        asyncio.run(serve(args.port, args.http_port, args.host))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
