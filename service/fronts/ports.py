"""The server's ports: one that cannot be bound stops start-up with one line that says which port it is
and the setting that changes it.

    ensure_bindable("port", host, port)     # before grpc binds: grpc itself says only "Failed to bind"
    raise port_error("http_port", host, port, e)

    cannot bind the HTTP port 127.0.0.1:8000: Address already in use; choose another with --http-port or
    ATTNSERVE_HTTP_PORT (0 = no HTTP front)
"""

from __future__ import annotations

import errno
import socket

from service.settings import flag_and_env

PORTS = {  # setting -> (what binds it, what 0 means)
    "port": ("gRPC", "any free port"),
    "http_port": ("HTTP", "no HTTP front"),
    "metrics_port": ("metrics", "no metrics server"),
}


def setting_names(name: str) -> str:
    flag, env = flag_and_env(name)
    return f"{flag} or {env}"


class PortUnavailable(OSError):
    """A port of the server cannot be bound; the message names the setting to change."""


def port_error(setting: str, host: str, port: int, reason: OSError | str) -> PortUnavailable:
    """The error for `setting`'s port: in use, or not bindable on `host` (then the host is the setting to change)."""
    what, zero = PORTS[setting]
    if isinstance(reason, OSError):
        wrong_host = isinstance(reason, socket.gaierror) or reason.errno == errno.EADDRNOTAVAIL
        reason = reason.strerror or str(reason)
        if wrong_host:
            return PortUnavailable(f"cannot bind the {what} port {host}:{port}: {reason}; {host!r} is not an address "
                                   f"of this machine: set another with {setting_names('host')}")
    return PortUnavailable(f"cannot bind the {what} port {host}:{port}: {reason}; choose another with "
                           f"{setting_names(setting)} (0 = {zero})")


def ensure_bindable(setting: str, host: str, port: int) -> None:
    """Raise `port_error` unless `port` can be bound on some address of `host`, as grpc would bind it
    (SO_REUSEADDR, so connections of a previous server in TIME_WAIT do not count). Port 0 always can."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise port_error(setting, host, port, e) from None
    first_error = None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
                return
            except OSError as e:
                first_error = first_error or e
    if first_error is not None:
        raise port_error(setting, host, port, first_error)
