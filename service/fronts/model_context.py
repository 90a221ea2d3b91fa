"""One served model as the fronts see it: its name, its bundle, its state, and once it serves, its engine and
what validation and the responses need of it (`ModelFacts`, `TokenTexts`).

    models = served_models(settings)     # one per bundle, named; duplicate names refused
    model.attach(engine)                 # warm: it serves
    engine = model.detach()              # unloaded: the engine is the caller's to shut down
    model.fail("its manifest is unreadable: ...")   # it will not serve; its requests are told why
    engine = model.ready()               # NotReady while loading, Unavailable once failed or unloaded

A model's state is one of `STATES`: unloaded -> loading -> serving -> unloading -> unloaded, or loading ->
failed. `unloaded` is a model the server knows but holds no engine for: the model pool loads it when it is
called (service/fronts/model_pool.py). The server's own state (accepting, draining) is `ServingContext`'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from service.engine.async_engine import AsyncEngine
from service.engine.errors import NotReady, Unavailable
from service.fronts.generation_defaults import sampling_defaults
from service.fronts.token_texts import TokenTexts
from service.fronts.validation import ModelFacts
from service.runtime.bundle import BundleError, read_manifest
from service.runtime.chat_template import ChatTemplate
from service.settings import ServerSettings

log = logging.getLogger("attnserve.server")

ModelState = Literal["unloaded", "loading", "serving", "unloading", "failed"]
STATES: tuple[ModelState, ...] = ("unloaded", "loading", "serving", "unloading", "failed")


class ModelContext:
    """A served model: `name` routes requests to it; `engine`, `facts` and `texts` are set while it serves."""

    def __init__(self, name: str, bundle: Path):
        self.name = name
        self.bundle = bundle
        self.state: ModelState = "unloaded"
        self.failure = ""  # why it failed, in the words its requests are told
        self.engine: AsyncEngine | None = None
        self.facts: ModelFacts | None = None
        self.texts: TokenTexts | None = None
        self.chat_template: tuple[ChatTemplate | None, str] | None = None  # (template, why there is none), read once
        # what the model pool keeps of it
        self.graph: str | None = None  # the graph it served when last loaded
        self.holders = 0  # calls using it now (from the model's choice to the call's end): it is not unloaded
        self.last_used = 0.0  # monotonic time a call last took or let go of it
        self.footprint = 0  # bytes of the budget it takes while loaded: weights, largest step, KV cache
        self.loads = 0  # times it was loaded
        self.load_seconds = 0.0  # how long its latest load took

    def attach(self, engine: AsyncEngine) -> None:
        """The model is loaded and warm: it serves on `engine`."""
        self.engine = engine
        self.graph = engine.runner.graph_name
        self.texts = TokenTexts(engine.tokenizer)
        n_ctx = engine.context  # the served context, which may be shorter than the model's
        longest = max(len(engine.tokenizer.decode([i])) for i in range(engine.model.vocab_size))
        # no longer text can tokenize to the prompt's limit (an encoder-decoder's: its longest source)
        prompt_tokens = engine.limits.max_prompt_tokens if engine.encoder_decoder else n_ctx
        self.facts = ModelFacts(engine.tokenizer, n_ctx, engine.limits,
                                max_prompt_chars=prompt_tokens * max(longest, 1),
                                sampling_defaults=sampling_defaults(engine.config.bundle))
        if self.facts.sampling_defaults:
            log.info("%s: sampling defaults from the model's generation config: %s", self.name,
                     self.facts.sampling_defaults)
        self.state = "serving"

    def detach(self) -> AsyncEngine | None:
        """The model no longer serves: its engine (to shut down) is handed back and what came of it forgotten."""
        engine, self.engine, self.facts, self.texts = self.engine, None, None, None
        self.state = "unloaded"
        return engine

    def fail(self, why: str) -> None:
        """The model will not serve; its requests are told `why`."""
        self.state, self.failure = "failed", why

    def ready(self) -> AsyncEngine:
        """The engine; NotReady while the model loads, Unavailable (naming why) once it failed or was unloaded."""
        if self.engine is not None and self.state == "serving":
            return self.engine
        if self.state in ("loading", "unloading"):
            raise NotReady(f"the model {self.name!r} is {self.state}; retry shortly")
        if self.state == "failed":
            raise Unavailable(f"the model {self.name!r} failed to load: {self.failure}")
        raise Unavailable(f"the model {self.name!r} is not loaded")


def served_models(settings: ServerSettings) -> list[ModelContext]:
    """A context per bundle, in order (the first is the default model), named by `served_model_name` or the
    bundle's manifest; a bundle whose manifest cannot be read is named by its folder and failed already.
    ValueError when two share a name."""
    names = settings.served_model_name or [None] * len(settings.bundle)
    models = []
    for bundle, name in zip(settings.bundle, names, strict=True):
        try:
            model = ModelContext(name or read_manifest(bundle).model.name, bundle)
        except (BundleError, OSError, ValueError) as e:
            model = ModelContext(name or Path(bundle).name, bundle)
            model.fail(f"its bundle {bundle} cannot be read: {e}")
        models.append(model)
    seen: dict[str, Path] = {}
    for model in models:
        if model.name in seen:
            raise ValueError(f"two bundles are served as the model {model.name!r}: {seen[model.name]} and "
                             f"{model.bundle}; name them apart with served_model_name (--served-model-name, once "
                             "per bundle)")
        seen[model.name] = model.bundle
    return models
