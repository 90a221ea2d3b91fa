"""What every front checks before a request reaches the engine: the bearer token, and the PEM files
of its TLS settings.

A front with `auth_token` or `auth_token_file` set refuses a call whose `authorization` header (gRPC
metadata or HTTP header) is not `Bearer <token>`; the comparison takes the same time whatever the
given value. What this does and does not protect is written down in docs/security.md.
"""

from __future__ import annotations

import hmac
from pathlib import Path

PEM_MARKER = b"-----BEGIN "
REFUSAL = "missing or wrong bearer token: send 'authorization: Bearer <token>'"


def read_pem(path: Path, what: str) -> bytes:
    data = path.read_bytes()
    if PEM_MARKER not in data:
        raise ValueError(f"{what} {path} is not PEM (no '-----BEGIN' line)")
    return data


class BearerAuth:
    """`authorized(value)`: is `value` (an `authorization` header) `Bearer <token>`?"""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def authorized(self, value: str | bytes | None) -> bool:
        if value is None:
            return False
        given = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(given, self._expected)
