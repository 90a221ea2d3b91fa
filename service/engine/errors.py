"""Domain errors. Each front maps each to its protocol's status in one place (`service.fronts.status`)."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine reports to a caller."""


class InvalidRequest(EngineError, ValueError):
    """A request the engine will not run; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Overloaded(EngineError):
    """The waiting queue is full; try again later."""


class DeadlineExceeded(EngineError):
    """The request's deadline passed, in the queue or while running."""


class Cancelled(EngineError):
    """The request was aborted."""


class ModelError(EngineError):
    """The server failed this request (a model call, or a bug); other requests are unaffected. The message is
    what the client is told, in its terms; `detail` (exception text, parser state) goes to the log only."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


class Unavailable(EngineError):
    """The server cannot take work now (still loading, or draining); another replica may."""


class NotReady(Unavailable):
    """The model is still loading or warming up."""


class EngineStopped(Unavailable):
    """The engine is shutting down (draining) and takes no new work."""


class UnknownModel(EngineError):
    """The request names a model the server does not serve; the message names those it does."""

    def __init__(self, name: str, served: list[str]):
        super().__init__(f"the model {name!r} does not exist; this server serves {', '.join(map(repr, served))}")
        self.name = name


class Forbidden(EngineError):
    """The call is one this server does not allow (an admin call on a server without a bearer token)."""
