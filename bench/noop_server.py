"""A TextGeneration server that generates nothing: it answers a stream with `max_new_tokens`
one-token messages as fast as gRPC sends them. It measures the load generator, not a model.

    python -m bench.noop_server --port 50052

`attnserve bench serve --noop-check` runs it in a child process and drives it with the same client
code and concurrency as the real run: the tokens per second it reaches is a lower bound on what
the client side can take in (the no-op server shares the machine with it).
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc

VOCAB = 4096
CONTEXT = 1 << 20


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


async def serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServicer_to_server(NoopGeneration(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.noop_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    try:
        asyncio.run(serve(args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
