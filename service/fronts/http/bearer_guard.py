"""The HTTP front's bearer-token check, as ASGI middleware: with a token set, every path but OPEN_PATHS
needs `Authorization: Bearer <token>`, or gets a 401 before the application reads the request. The Messages
API's paths also take the token as Anthropic's clients send it, `x-api-key: <token>`, and answer a 401 in
Anthropic's shape."""

from __future__ import annotations

from service.fronts.auth import REFUSAL, BearerAuth
from service.fronts.http.anthropic_errors import anthropic_error_response
from service.fronts.http.errors import error_response
from service.fronts.serving_context import ServingContext
from service.fronts.status import HttpStatus

OPEN_PATHS = frozenset({"/health"})
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
          "/models/load", "/models/unload", "/health", *sorted(ANTHROPIC_PATHS))  # metric labels; others are "other"
ANTHROPIC_REFUSAL = "missing or wrong API key: send 'x-api-key: <token>' or 'authorization: Bearer <token>'"


class BearerGuard:
    """ASGI middleware: with a token set, every path but OPEN_PATHS needs `Authorization: Bearer <token>`."""

    def __init__(self, app, token: str | None, serving: ServingContext):
        self.app = app
        self.auth = BearerAuth(token) if token else None
        self.serving = serving

    async def __call__(self, scope, receive, send) -> None:
        if self.auth is not None and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            anthropic = scope["path"] in ANTHROPIC_PATHS
            if not self._authorized(scope["headers"], anthropic):
                path = scope["path"] if scope["path"] in ROUTES else "other"  # no label per random path
                self.serving.metrics.requests.labels("http", path, "401").inc()
                if anthropic:
                    response = anthropic_error_response(HttpStatus(401, "authentication_error", ANTHROPIC_REFUSAL))
                else:
                    response = error_response(HttpStatus(401, "authentication_error", REFUSAL))
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorized(self, headers: list[tuple[bytes, bytes]], api_key: bool) -> bool:
        """`Authorization: Bearer <token>`, or with `api_key` also `x-api-key: <token>` (the first of each)."""
        if self.auth.authorized(next((v for k, v in headers if k == b"authorization"), None)):
            return True
        key = next((v for k, v in headers if k == b"x-api-key"), None) if api_key else None
        return key is not None and self.auth.authorized(b"Bearer " + key)
