"""One call on any front: its request id (in every log line), its latency metrics, and the count of
calls by protocol, method and outcome.

    call = Call(serving, "grpc", "GenerateStream")
    call.hold(model)                     # the model the call runs on is not unloaded until it is finished
    call.accepted(accepted, stream)      # the engine took it
    call.observe(events, stream)         # as tokens arrive (metrics labelled with the call's model)
    call.finished("OK", ok=True)         # once, however it ends
"""

from __future__ import annotations

import logging
import time

from service import logs
from service.engine.async_engine import RequestStream
from service.engine.request import TokenEvent
from service.fronts.model_context import ModelContext
from service.fronts.serving_context import ServingContext
from service.fronts.validation import AcceptedRequest

log = logging.getLogger("attnserve.server")

class Call:
    """One call in progress, on any front: its request id (in every log line), latency metrics, and
    the count of calls by protocol, method and outcome."""

    def __init__(self, serving: ServingContext, protocol: str, method: str):
        self.serving, self.protocol, self.method = serving, protocol, method
        self.metrics = serving.metrics
        self.model: ModelContext | None = None  # the model it runs on, once it is known
        self.admitted: AcceptedRequest | None = None  # its (first) request, once the engine took it
        self.streams: list[RequestStream] = []
        self.tokens = 0
        self.prompt_tokens = 0
        self._last: dict[tuple[int, int], float] = {}  # (stream, completion index) -> time of its latest token
        self._started: set[int] = set()  # streams whose first token was observed
        self._held: list[ModelContext] = []  # models held for it (`ServingContext.take`), let go when it finishes

    def hold(self, model: ModelContext) -> None:
        self._held.append(model)

    def accepted(self, accepted: AcceptedRequest, stream: RequestStream) -> None:
        self.admitted = accepted
        self.streams.append(stream)
        logs.request_id.set(accepted.request_id)
        self.prompt_tokens += len(accepted.request.prompt_token_ids)
        self.metrics.prompt_tokens.labels(self._model).inc(len(accepted.request.prompt_token_ids))

    def observe(self, events: list[TokenEvent], stream: RequestStream) -> None:
        key = id(stream)
        if events and key not in self._started:
            self._started.add(key)
            t = stream.timing
            self.metrics.time_to_first_token.labels(self._model).observe(t.first_token_at - t.arrival)
            self.metrics.queue_duration.labels(self._model).observe((t.scheduled_at or t.first_token_at) - t.arrival)
        itl = self.metrics.inter_token_latency.labels(self._model)
        for e in events:
            prev = self._last.get((key, e.index))
            if prev is not None:
                itl.observe(e.time - prev)
            self._last[(key, e.index)] = e.time
        self.tokens += len(events)
        self.metrics.generated_tokens.labels(self._model).inc(len(events))

    @property
    def _model(self) -> str:
        """The `model` label of its metrics (the engine took it, so the model is known)."""
        return self.model.name if self.model is not None else ""

    def finished(self, code: str, ok: bool) -> None:
        """`code`: the protocol's own (a gRPC status name, an HTTP status number)."""
        held, self._held = self._held, []
        for model in held:
            self.serving.let_go(model)
        self.metrics.requests.labels(self.protocol, self.method, code).inc()
        if self.admitted is None:
            return
        total = time.monotonic() - min(s.timing.arrival for s in self.streams)
        if ok:
            self.metrics.request_duration.labels(self._model).observe(total)
            self.serving.completions.append(time.monotonic())
        log.info("%s %s %s", self.protocol, self.method, code, extra={
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens, "total_ms": round(1000 * total, 1),
            "model": self._model})
