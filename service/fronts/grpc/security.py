"""The gRPC front's transport security and authentication: TLS, mutual TLS, a bearer token.

- TLS: `tls_cert_file` + `tls_key_file` (PEM). The port then speaks TLS only.
- Mutual TLS: `tls_client_ca_file` as well; a client must present a certificate that CA signed,
  or the handshake fails before any call reaches the server.
- Bearer token: `auth_token` or `auth_token_file`. Every call but the health service's must carry
  `authorization: Bearer <token>` in its metadata, or it ends with UNAUTHENTICATED before the
  servicer runs. Health stays open so that load balancers and kubelet probes need no secret.

What this does and does not protect is written down in docs/security.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health

from service.fronts.auth import REFUSAL, BearerAuth, read_pem

OPEN_SERVICES = (health.SERVICE_NAME,)  # callable without a token


def server_credentials(cert_file: Path | None, key_file: Path | None,
                       client_ca_file: Path | None) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port, or None for plaintext."""
    if cert_file is None or key_file is None:
        return None
    cert = read_pem(cert_file, "tls_cert_file")
    key = read_pem(key_file, "tls_key_file")
    client_ca = read_pem(client_ca_file, "tls_client_ca_file") if client_ca_file is not None else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


class BearerToken(grpc.aio.ServerInterceptor):
    """Ends every call without the right `authorization: Bearer <token>` with UNAUTHENTICATED,
    except the open services' (health)."""

    def __init__(self, token: str):
        self._auth = BearerAuth(token)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service = details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service in OPEN_SERVICES or self._authorized(details.invocation_metadata):
            return handler
        return _refusal(handler)

    def _authorized(self, metadata) -> bool:
        return self._auth.authorized(next((value for key, value in metadata or () if key == "authorization"), None))


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse_stream if handler.response_streaming else refuse,
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
