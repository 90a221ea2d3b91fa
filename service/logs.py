"""Structured logs: every line carries the request id of the RPC that wrote it.

The servicer sets `request_id` (a ContextVar, so each RPC's task has its own); a filter copies it
onto every record. `--log-format json` writes one JSON object per line, with any `extra=` fields.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "request_id"}


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        line.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)-7s %(name)s [%(request_id)s] %(message)s%(fields)s")

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in vars(record).items() if k not in _STANDARD and k != "fields"}
        record.fields = "".join(f" {k}={v}" for k, v in extra.items())
        return super().format(record)


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class ThrottledLoopErrors:
    """An event-loop exception handler that logs each kind of error at most once per `interval_s`, with
    how many it left out. A process out of file handles makes asyncio report every failed accept; without
    this, a flood of connections turns into a flood of log lines."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}
        self._log = logging.getLogger("attnserve.server")

    def __call__(self, loop, context: dict) -> None:
        kind = str(context.get("message", "")) + type(context.get("exception")).__name__
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval_s) < self.interval_s:
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
            return
        self._last[kind] = now
        dropped = self._dropped.pop(kind, 0)
        exception = context.get("exception")
        self._log.error("%s%s%s", context.get("message", "event loop error"),
                        f": {exception}" if exception is not None else "",
                        f" ({dropped} more like it in the last {self.interval_s:g} s)" if dropped else "",
                        exc_info=exception if exception is not None and not dropped else None)
