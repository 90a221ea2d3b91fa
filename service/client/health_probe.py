"""`attnserve health`: exit 0 if a server's gRPC health service reports SERVING, 1 otherwise.

    attnserve health                          # 127.0.0.1:$ATTNSERVE_PORT (default 50051)
    attnserve health --server host:50051 --service attnserve.v1.TextGeneration

The container's HEALTHCHECK runs it. It needs only grpcio and the health stubs.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve.arguments import HintingParser


def check(address: str, service: str = "", timeout_s: float = 3.0,
          credentials: grpc.ChannelCredentials | None = None) -> str:
    """The status name the server reports ("SERVING", "NOT_SERVING", ...). Health needs no token."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve health", description=__doc__.split("\n\n")[0])
    # --server, as in `attnserve generate`; --address, its earlier name, still works
    p.add_argument("--server", "--address", metavar="HOST:PORT",
                   default=f"127.0.0.1:{os.environ.get('ATTNSERVE_PORT', '50051')}",
                   help="the server's gRPC address (default: 127.0.0.1:$ATTNSERVE_PORT, else 50051)")
    p.add_argument("--service", default="", help="service name to ask about ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.add_argument("--tls-ca", metavar="PEM", default=os.environ.get("ATTNSERVE_HEALTH_TLS_CA"),
                   help="connect with TLS, trusting this CA (default: $ATTNSERVE_HEALTH_TLS_CA)")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate, for a server that requires mutual TLS")
    p.add_argument("--tls-key", metavar="PEM", help="the client certificate's key")
    args = p.parse_args(argv)
    try:
        credentials = None
        if args.tls_ca or args.tls_cert:
            from service.client.grpc_client import channel_credentials

            credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        status = check(args.server, args.service, args.timeout, credentials)
    except grpc.RpcError as e:
        print(f"{args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"{args.server}: {e}", file=sys.stderr)
        return 1
    print(f"{args.server}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    raise SystemExit(main())
