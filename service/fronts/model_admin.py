"""Loading and unloading a model by hand, for both fronts (HTTP `POST /models/load` and `/models/unload`, gRPC
`LoadModel` and `UnloadModel`), and what is known of a model whether or not it is loaded.

    model = await load_model(serving, "qwen")     # Forbidden without a server token; UnknownModel; Unavailable
    model = await unload_model(serving, "qwen")
    spec, context = described(model, settings)    # from its engine once loaded, else its manifest

Both need the server's bearer token (the guard on each front checks it); a server started without one refuses
them, as an unguarded unload would let any client empty the server.
"""

from __future__ import annotations

from service.engine.cache_plan import served_context
from service.engine.errors import Forbidden, Unavailable
from service.fronts.model_context import ModelContext
from service.fronts.serving_context import ServingContext
from service.runtime.bundle import BundleError, ModelSpec, read_manifest
from service.settings import ServerSettings

NO_TOKEN = ("loading and unloading models needs the server's bearer token, and this server has none: start it with "
            "auth_token (--auth-token) or auth_token_file")


async def load_model(serving: ServingContext, name: str) -> ModelContext:
    """The model `name` names (empty: the default), loaded; a failed one is tried again."""
    model = _admin(serving, name)
    await serving.pool.load(model)
    if model.state != "serving":
        model.ready()  # raises, naming why
    return model


async def unload_model(serving: ServingContext, name: str) -> ModelContext:
    """The model `name` names, unloaded once the calls using it are over."""
    model = _admin(serving, name)
    await serving.pool.unload(model)
    return model


def _admin(serving: ServingContext, name: str) -> ModelContext:
    if not serving.settings.bearer_token():
        raise Forbidden(NO_TOKEN)
    serving.admit_calls()
    model = serving.resolve(name)
    if serving.pool is None:
        raise Unavailable("this server loads its models once, at start-up")
    return model


def described(model: ModelContext, settings: ServerSettings) -> tuple[ModelSpec | None, int]:
    """What `model` is and the context it serves (or will serve), whether or not it is loaded: from its
    engine once loaded, else its manifest; (None, 0) when its bundle cannot be read."""
    if model.engine is not None and model.state == "serving":
        return model.engine.model, model.engine.context
    try:
        spec = read_manifest(model.bundle).model
        return spec, served_context(settings.engine_config(model.bundle), spec.n_ctx)
    except (BundleError, OSError, ValueError):
        return None, 0
