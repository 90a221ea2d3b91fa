"""The gRPC port's channel arguments: message sizes, and the limits that keep connections a bounded
resource (docs/security.md#connections).

- `max_connections` → `grpc.max_allowed_incoming_connections`: a connection past it is closed at once
  (the client sees UNAVAILABLE, which it may retry).
- `header_timeout_s` → `grpc.server_handshake_timeout_ms`: a connection that does not finish its
  handshake (TLS and the HTTP/2 preface) in time is closed.
- `idle_timeout_s` → `grpc.max_connection_idle_ms`: a connection without calls that long gets GOAWAY.
- `max_connection_age_s` → `grpc.max_connection_age_ms`, with `grace_period_s` for the calls in flight.
- Keepalive: the server pings a connection with calls every KEEPALIVE_TIME_S and closes it when no
  answer comes within KEEPALIVE_TIMEOUT_S, so a client that vanished without closing is noticed.
"""

from __future__ import annotations

from service.settings import ServerSettings

KEEPALIVE_TIME_S = 60
KEEPALIVE_TIMEOUT_S = 20


def server_options(settings: ServerSettings, max_connections: int) -> list[tuple[str, int]]:
    s = settings
    options = [
        ("grpc.max_receive_message_length", s.max_receive_message_bytes),
        ("grpc.max_send_message_length", s.max_send_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", _ms(s.header_timeout_s)),
        ("grpc.max_connection_idle_ms", _ms(s.idle_timeout_s)),
        ("grpc.keepalive_time_ms", _ms(KEEPALIVE_TIME_S)),
        ("grpc.keepalive_timeout_ms", _ms(KEEPALIVE_TIMEOUT_S)),
    ]
    if s.max_connection_age_s:
        options += [("grpc.max_connection_age_ms", _ms(s.max_connection_age_s)),
                    ("grpc.max_connection_age_grace_ms", _ms(s.grace_period_s))]
    return options


def _ms(seconds: float) -> int:
    return max(1, round(1000 * seconds))
