"""Python clients for the attnserve gRPC API: `Client` (blocking) and `AsyncClient` (asyncio).

    from service.client import Client
    with Client("localhost:50051") as c:
        print(c.generate("ROMEO:", max_new_tokens=40, temperature=0.8, seed=1).completions[0].text)
        for delta in c.stream("JULIET:", max_new_tokens=40):
            print(delta, end="", flush=True)

    async with AsyncClient("localhost:50051") as c:
        response = await c.generate("ROMEO:")
        async for delta in c.stream("ROMEO:"):
            ...

Against a server with TLS, pass `credentials=channel_credentials(ca_file=...)` (and a client
certificate and key for mutual TLS); with a bearer token, `token="..."` (docs/security.md).

Keyword arguments are the fields of `GenerateRequest`, `SamplingParams` and `StoppingCriteria`
(docs/api.md); left out, they take the server's defaults. Errors are raised as `grpc.RpcError`
(`grpc.aio.AioRpcError` for the async client), whose `.code()` is the status (docs/api.md#errors).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import grpc

from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from service.fronts.auth import read_pem

SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)
STOPPING_FIELDS = frozenset(pb.StoppingCriteria.DESCRIPTOR.fields_by_name)
REQUEST_FIELDS = frozenset(pb.GenerateRequest.DESCRIPTOR.fields_by_name) - {"prompt", "sampling", "stopping"}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name

# The channel's service config (https://github.com/grpc/grpc/blob/master/doc/service_config.md): a call that ends
# before any response with UNAVAILABLE (a replica that is draining, or went away) or CANCELLED (the server's
# transport dropped it as it arrived, when a drain closed the port under it) is sent again, up to 5 attempts
# in all; through round robin, to the next replica. Every call of the API leaves the server as it found it, so
# sending one again is safe; a stream that has received its first message is never sent again (that would
# repeat tokens), and a call the client itself cancels is not retried. docs/deploy.md#retries-and-health-checks.
RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "1s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]}


def service_config(round_robin: bool = False) -> dict:
    """`round_robin`: the target resolves to every replica's own address (a headless Service's DNS name, or
    `ipv4:10.0.0.11:50051,10.0.0.12:50051`): balance calls over them, one call at a time, and pick a replica only
    while its health service reports SERVING (one that loads or drains gets no new calls). Not through a proxy
    (nginx, Envoy, an ingress): it balances itself, and the health it answers is one replica's, not its own."""
    config = {"methodConfig": [{"name": [{"service": SERVICE_NAME}], "retryPolicy": RETRY_POLICY}]}
    if round_robin:
        config |= {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": SERVICE_NAME}}
    return config


def channel_options(round_robin: bool = False) -> list[tuple[str, object]]:
    return [
        ("grpc.max_receive_message_length", 64 * 2**20),
        ("grpc.service_config", json.dumps(service_config(round_robin))),
        ("grpc.enable_retries", 1),
        # a replica restarted on its address is connected again within 2 s, not after a backoff of minutes
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


CHANNEL_OPTIONS = channel_options()


def build_request(prompt: str | Iterable[int], **fields) -> pb.GenerateRequest:
    """A `GenerateRequest` from a text prompt (or token ids) and flat keyword fields."""
    sampling = {k: fields.pop(k) for k in list(fields) if k in SAMPLING_FIELDS}
    stopping = {k: fields.pop(k) for k in list(fields) if k in STOPPING_FIELDS}
    unknown = set(fields) - REQUEST_FIELDS
    if unknown:
        raise TypeError(f"unknown request field(s) {sorted(unknown)}; see docs/api.md")
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    else:
        fields["prompt_token_ids"] = list(prompt)
    sampling = {k: v for k, v in sampling.items() if v is not None}  # None = unset = server default
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), stopping=pb.StoppingCriteria(**stopping),
                              **{k: v for k, v in fields.items() if v is not None})


def channel_credentials(ca_file: str | Path | None = None, cert_file: str | Path | None = None,
                        key_file: str | Path | None = None) -> grpc.ChannelCredentials:
    """Client side: trust `ca_file` (None = the system's roots); present `cert_file`/`key_file`
    to a server that asks for mutual TLS."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate and its key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(Path(ca_file), "CA file") if ca_file else None,
        private_key=read_pem(Path(key_file), "client key") if key_file else None,
        certificate_chain=read_pem(Path(cert_file), "client certificate") if cert_file else None)


def call_metadata(metadata: Iterable[tuple[str, str]], token: str | None) -> tuple[tuple[str, str], ...]:
    return tuple(metadata) + ((("authorization", f"Bearer {token}"),) if token else ())


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """--token, --tls-ca, --tls-cert, --tls-key: how a command reaches a secured server."""
    g = p.add_argument_group("connection (docs/security.md)")
    g.add_argument("--token", default=os.environ.get("ATTNSERVE_TOKEN"),
                   help="bearer token for a server that requires one (default: $ATTNSERVE_TOKEN)")
    g.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA (a server with tls_cert_file)")
    g.add_argument("--tls-cert", metavar="PEM", help="client certificate, for a server that requires mutual TLS")
    g.add_argument("--tls-key", metavar="PEM", help="the client certificate's key")


def connection_options(args: argparse.Namespace) -> dict:
    """`Client` keyword arguments from the flags of `add_connection_flags`."""
    tls = args.tls_ca or args.tls_cert
    return {"token": args.token,
            "credentials": channel_credentials(args.tls_ca, args.tls_cert, args.tls_key) if tls else None}


class Client:
    """Blocking client. `timeout_s` is each call's deadline unless a call passes its own. `round_robin`: the
    target names every replica (a headless Service), and calls are balanced over the healthy ones
    (`service_config`). Calls that end UNAVAILABLE or CANCELLED before any response are retried either way."""

    def __init__(self, target: str = "localhost:50051", *, timeout_s: float | None = None,
                 metadata: Iterable[tuple[str, str]] = (), channel: grpc.Channel | None = None,
                 token: str | None = None, credentials: grpc.ChannelCredentials | None = None,
                 round_robin: bool = False):
        options = channel_options(round_robin)
        self.channel = channel or (grpc.secure_channel(target, credentials, options=options) if credentials
                                   else grpc.insecure_channel(target, options=options))
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = call_metadata(metadata, token)

    def generate(self, prompt: str | Iterable[int], *, timeout_s: float | None = None, **fields) -> pb.GenerateResponse:
        """The whole result: `.completions[i].text`, `.token_ids`, `.finish_reason`, and `.usage`."""
        return self.stub.Generate(build_request(prompt, **fields), timeout=timeout_s or self.timeout_s,
                                  metadata=self.metadata)

    def stream_responses(self, prompt: str | Iterable[int], *, timeout_s: float | None = None,
                         **fields) -> Iterator[pb.GenerateStreamResponse]:
        """Every `GenerateStreamResponse`, as it arrives. Closing the iterator cancels the request."""
        call = self.stub.GenerateStream(build_request(prompt, **fields), timeout=timeout_s or self.timeout_s,
                                        metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def stream(self, prompt: str | Iterable[int], **fields) -> Iterator[str]:
        """Text deltas as they are generated (of every completion, in arrival order, when n > 1)."""
        for msg in self.stream_responses(prompt, **fields):
            if msg.text:
                yield msg.text

    def tokenize(self, text: str, model: str = "") -> pb.TokenizeResponse:
        """`text` in `model`'s tokens (empty: the server's default model)."""
        return self.stub.Tokenize(pb.TokenizeRequest(text=text, model=model), timeout=self.timeout_s,
                                  metadata=self.metadata)

    def model_info(self, model: str = "") -> pb.ModelInfo:
        """`model`'s description (empty: the server's default model)."""
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(model=model), timeout=self.timeout_s,
                                      metadata=self.metadata)

    def server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.timeout_s, metadata=self.metadata)

    def list_models(self) -> list[pb.ModelInfo]:
        """Every served model, the default first, loaded or not (`state`)."""
        return list(self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s, metadata=self.metadata).models)

    def load_model(self, model: str = "") -> pb.ModelInfo:
        """Load `model` now (needs the server's token); returns once it serves."""
        return self.stub.LoadModel(pb.LoadModelRequest(model=model), timeout=self.timeout_s, metadata=self.metadata)

    def unload_model(self, model: str = "") -> pb.ModelInfo:
        """Unload `model` once the calls using it are over (needs the server's token)."""
        return self.stub.UnloadModel(pb.UnloadModelRequest(model=model), timeout=self.timeout_s,
                                     metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client; the same calls as `Client`, awaited (and `stream` as an async iterator)."""

    def __init__(self, target: str = "localhost:50051", *, timeout_s: float | None = None,
                 metadata: Iterable[tuple[str, str]] = (), channel: grpc.aio.Channel | None = None,
                 token: str | None = None, credentials: grpc.ChannelCredentials | None = None,
                 round_robin: bool = False):
        options = channel_options(round_robin)
        self.channel = channel or (
            grpc.aio.secure_channel(target, credentials, options=options) if credentials
            else grpc.aio.insecure_channel(target, options=options))
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = call_metadata(metadata, token)

    async def generate(self, prompt: str | Iterable[int], *, timeout_s: float | None = None,
                       **fields) -> pb.GenerateResponse:
        return await self.stub.Generate(build_request(prompt, **fields), timeout=timeout_s or self.timeout_s,
                                        metadata=self.metadata)

    async def stream_responses(self, prompt: str | Iterable[int], *, timeout_s: float | None = None,
                               **fields) -> AsyncIterator[pb.GenerateStreamResponse]:
        call = self.stub.GenerateStream(build_request(prompt, **fields), timeout=timeout_s or self.timeout_s,
                                        metadata=self.metadata)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def stream(self, prompt: str | Iterable[int], **fields) -> AsyncIterator[str]:
        async for msg in self.stream_responses(prompt, **fields):
            if msg.text:
                yield msg.text

    async def tokenize(self, text: str, model: str = "") -> pb.TokenizeResponse:
        return await self.stub.Tokenize(pb.TokenizeRequest(text=text, model=model), timeout=self.timeout_s,
                                        metadata=self.metadata)

    async def model_info(self, model: str = "") -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(model=model), timeout=self.timeout_s,
                                            metadata=self.metadata)

    async def list_models(self) -> list[pb.ModelInfo]:
        return list((await self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s,
                                                metadata=self.metadata)).models)

    async def load_model(self, model: str = "") -> pb.ModelInfo:
        return await self.stub.LoadModel(pb.LoadModelRequest(model=model), timeout=self.timeout_s,
                                         metadata=self.metadata)

    async def unload_model(self, model: str = "") -> pb.ModelInfo:
        return await self.stub.UnloadModel(pb.UnloadModelRequest(model=model), timeout=self.timeout_s,
                                           metadata=self.metadata)

    async def server_info(self) -> pb.ServerInfo:
        return await self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.timeout_s,
                                             metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
