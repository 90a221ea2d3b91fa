"""The HTTP front's bearer-token check, as ASGI middleware: with a token set, every path but OPEN_PATHS
needs `Authorization: Bearer <token>`, or gets a 401 before the application reads the request."""

from __future__ import annotations

from service.fronts.auth import REFUSAL, BearerAuth
from service.fronts.http.errors import error_response
from service.fronts.serving_context import ServingContext
from service.fronts.status import HttpStatus

OPEN_PATHS = frozenset({"/health"})
# metric labels; others are "other"
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
          "/health")


class BearerGuard:
    """ASGI middleware: with a token set, every path but OPEN_PATHS needs `Authorization: Bearer <token>`."""

    def __init__(self, app, token: str | None, serving: ServingContext):
        self.app = app
        self.auth = BearerAuth(token) if token else None
        self.serving = serving

    async def __call__(self, scope, receive, send) -> None:
        if self.auth is not None and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            value = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not self.auth.authorized(value):
                path = scope["path"] if scope["path"] in ROUTES else "other"  # no label per random path
                self.serving.metrics.requests.labels("http", path, "401").inc()
                response = error_response(HttpStatus(401, "authentication_error", REFUSAL))
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
