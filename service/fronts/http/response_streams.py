"""How a response body goes out when it is not one JSON write: as server-sent events, or as a large JSON
body encoded a choice at a time. The bodies themselves are their builders' (`BodyBuilder`: OpenAI's in
`openai_responses`).

    yield sse(chunk) ... yield DONE                           # inside an SSEResponse(content, cleanup, headers)
    StreamingResponse(json_pieces(response), media_type="application/json")
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from starlette.responses import StreamingResponse

from service.engine.request import TokenEvent
from service.engine.sequence import Timing
from service.fronts.status import HttpStatus

DONE = b"data: [DONE]\n\n"


async def json_pieces(response: dict[str, Any]) -> AsyncIterator[bytes]:
    """A whole response as JSON, one choice at a time, letting the event loop run between them: the
    largest (256 choices of 250 tokens with 20 alternatives each, 25 MB) takes 0.56 s in one go."""
    marker = "\0choices\0"
    head, tail = _dumps({**response, "choices": marker}).split(_dumps(marker))
    yield (head + "[").encode()
    for i, choice in enumerate(response["choices"]):
        yield (("," if i else "") + _dumps(choice)).encode()
        await asyncio.sleep(0)
    yield ("]" + tail).encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class BodyBuilder(Protocol):
    """An API's answer, built from the engine's events: whole (`add`, then `response`) or as a stream (`stream_head`,
    `chunks` as events come, `stream_tail`; `stream_error` when the stream fails after it began)."""

    timings_of: Callable[[], list[Timing]]  # each request's timing record so far (cached tokens, times): set once
    # they run

    def add(self, stream_index: int, events: list[TokenEvent]) -> None: ...

    def response(self) -> dict[str, Any]: ...

    def stream_head(self) -> list[bytes]: ...

    def chunks(self, stream_index: int, events: list[TokenEvent]) -> list[bytes]: ...

    def stream_tail(self) -> list[bytes]: ...

    def stream_error(self, status: HttpStatus) -> list[bytes]: ...


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A server-sent-event stream whose `cleanup` runs however the response ends, even before it starts."""

    def __init__(self, content, cleanup, headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()
