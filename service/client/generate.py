"""`attnserve generate`: text from a running server (`--server`) or from an ONNX bundle in-process. No torch.

    attnserve generate "Rom." --stream --temperature 0.8 --max-new-tokens 100 --server localhost:50051
    attnserve generate "ROMEO:" --max-new-tokens 80 --temperature 0.8 --top-p 0.95 --seed 1
    attnserve generate "To be" -n 3 --stop "\\n\\n" --bundle models/shakespeare-onnx

Both modes send the same `GenerateRequest` and apply the same defaults (docs/api.md): flags left
out take the server's defaults. With n = 1 the text is printed as it arrives (`--stream` asks a
server for GenerateStream; the in-process engine always streams); with n > 1 each completion is
printed whole. The finish reason goes to stderr. A decoder's completion continues its prompt, so the
prompt is printed before it; an encoder-decoder's completion is a new text (the G2P model's phonemes
of a word), printed alone. `--echo` / `--no-echo` choose either way.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import grpc

from attnserve.arguments import HintingParser
from attnserve.v1 import generate_pb2 as pb
from service.client import Client, add_connection_flags, build_request, connection_options
from service.engine.config import AUTO_GRAPH, DEFAULT_BUNDLE

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower() for k, v in pb.FinishReason.items()}


def build_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="attnserve generate", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt")
    where = p.add_argument_group("where").add_mutually_exclusive_group()
    where.add_argument("--server", metavar="HOST:PORT", help="a running attnserve server (default: in-process)")
    where.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="ONNX bundle for the in-process engine")
    p.add_argument("--graph", default=AUTO_GRAPH, help="graph in-process (default: auto, the fastest that passes the "
                                                       "self-check on this CPU)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive (GenerateStream)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds (with --server)")
    add_connection_flags(p)
    p.add_argument("-n", type=int, default=1, help="completions from the one prompt")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0 = the server's default")
    p.add_argument("--min-new-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; default 1.0")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--echo", action=argparse.BooleanOptionalAction, default=None,
                   help="print the prompt before the completion (default: for a decoder's continuation, not for "
                        "an encoder-decoder's target)")
    return p


def request_of(args: argparse.Namespace) -> pb.GenerateRequest:
    return build_request(args.prompt, n=args.n, max_new_tokens=args.max_new_tokens,
                         min_new_tokens=args.min_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                         presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                         seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


class Printer:
    """Prints stream messages: text as it comes for n = 1, whole completions at the end for n > 1."""

    def __init__(self, prompt: str, n: int):
        self.prompt, self.n = prompt, n
        self.texts = [""] * n
        self.started = False

    def message(self, msg: pb.GenerateStreamResponse) -> None:
        self.texts[msg.index] += msg.text
        if self.n == 1:
            print(("" if self.started else self.prompt) + msg.text, end="", flush=True)
            self.started = True
            if msg.finish_reason:
                print(f"\n[{FINISH_NAMES[msg.finish_reason]}]", file=sys.stderr)

    def response(self, response: pb.GenerateResponse) -> None:
        for c in response.completions:
            self.message(pb.GenerateStreamResponse(index=c.index, text=c.text, finish_reason=c.finish_reason))

    def close(self) -> None:
        if self.n > 1:
            for i, text in enumerate(self.texts):
                print(f"--- {i}\n{self.prompt}{text}")


def run_remote(args: argparse.Namespace) -> int:
    try:
        with Client(args.server, timeout_s=args.timeout, **connection_options(args)) as client:
            echo = args.echo
            if echo is None:  # the model says whether the completion continues the prompt
                info = client.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout,
                                                metadata=client.metadata)
                echo = info.kind != "encoder-decoder"
            printer = Printer(args.prompt if echo else "", max(args.n, 1))
            request = request_of(args)
            if args.stream:
                call = client.stub.GenerateStream(request, timeout=args.timeout, metadata=client.metadata)
                for msg in call:
                    printer.message(msg)
            else:
                printer.response(client.stub.Generate(request, timeout=args.timeout, metadata=client.metadata))
    except grpc.RpcError as e:
        print(f"\nattnserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() is grpc.StatusCode.INVALID_ARGUMENT else 1
    printer.close()
    return 0


async def run_local(args: argparse.Namespace) -> int:
    """The bundle served in this process, on a loopback port only this command uses, and the request
    sent to it as to any server: one path for both modes."""
    from service.runtime.bundle import BundleError
    from service.server import Server
    from service.settings import ServerSettings

    settings = ServerSettings(bundle=args.bundle, graph=args.graph, max_running=max(args.n, 1) + 1, host="127.0.0.1",
                              port=0, http_port=0, metrics_port=0, warmup=False, auth_token=None, auth_token_file=None,
                              tls_cert_file=None, tls_key_file=None, tls_client_ca_file=None)
    server = Server(settings)
    try:
        await server.start()
    except (BundleError, OSError) as e:
        await server.drain(0)
        print(f"attnserve generate: {e}", file=sys.stderr)
        return 1
    try:
        local = argparse.Namespace(**{**vars(args), "server": f"127.0.0.1:{server.port}", "stream": args.n <= 1,
                                      "token": None, "tls_ca": None, "tls_cert": None})
        return await asyncio.to_thread(run_remote, local)
    finally:
        await server.drain(0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.server:
        return run_remote(args)
    return asyncio.run(run_local(args))


if __name__ == "__main__":
    raise SystemExit(main())
