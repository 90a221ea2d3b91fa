"""Which of the served models are loaded: a model is loaded when it is called, and unloaded when it has been
idle for `keep_alive_s`, when the memory budget (or `max_loaded_models`) needs room for another, least
recently used first, or when an operator asks.

    pool = ModelPool(settings, models, loader)
    await pool.start()                        # the models `preload` names, in order, while they fit
    engine = await pool.acquire(model)        # loaded first if need be (the caller waits; no one else does)
    pool.release(model)                       # the call is over: the model may be unloaded again
    await pool.load(model); await pool.unload(model)   # the admin endpoints
    await pool.close()                        # the drain: no more loads, the idle watch stops

What a loaded model takes of the budget (its `footprint`) is counted, not measured: its graph's files, its
largest step's activations (`activation_bytes`) and its KV cache, which `kv_shares` sizes once for every
model before any loads. The process's own memory before any model (`held`) and the margin come off the
budget first. A model is loaded only when what loaded models take leaves room for it; otherwise idle models
are unloaded, least recently used first, and if every loaded model is busy the load waits until one is not.
A model too large for the budget alone fails, its requests told why; so does one whose bundle cannot load,
and the others go on serving.

A model is never unloaded while a call holds it (`holders`, from the moment a call picks the model to its
end), so unloading never fails a request: a call that arrives while its model unloads waits, and loads it
again. Loads run one at a time (each uses every core, and room is judged one load at a time); calls to
models already loaded go on meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from service.engine.async_engine import AsyncEngine
from service.engine.cache_plan import MARGIN_BYTES, activation_bytes, kv_shares, served_context
from service.engine.errors import NotReady
from service.fronts.model_context import ModelContext
from service.runtime.bundle import BundleError, read_manifest
from service.runtime.memory import budget_bytes, memory_limit, resident_bytes, return_freed_memory
from service.settings import ServerSettings

log = logging.getLogger("attnserve.server")

MiB = 2**20
IDLE_CHECK_S = 1.0  # how often idle models are looked for (at most)


class Loader(Protocol):
    async def load(self, model: ModelContext, kv_bytes: int | None,
                   status: Callable[[str], None] = ...) -> AsyncEngine: ...

    def weight_bytes(self, model: ModelContext) -> int: ...


class ModelPool:
    """The served models' loading and unloading, within the memory budget."""

    def __init__(self, settings: ServerSettings, models: list[ModelContext], loader: Loader,
                 status: Callable[[str], None] = lambda _: None):
        self.settings = settings
        self.models = models
        self.loader = loader
        self.status = status  # what loading is doing now, for the start-up's log (names the model)
        self.budget = budget_bytes(settings.memory_budget, memory_limit())
        self.held = resident_bytes()  # the process before any model
        self.kv_bytes: dict[str, int] = {}  # each model's KV cache (several models; one alone plans its own)
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._released = asyncio.Condition()  # a call let go of a model: a waiting load may find room
        self._loading: dict[str, asyncio.Task] = {}
        self._watch: asyncio.Task | None = None
        self._notices: set[asyncio.Task] = set()  # wake-ups of waiting loads, kept until they ran
        self._starting = True  # a single model's failure fails the start-up; later, its requests are told
        self._closed = False

    @property
    def several(self) -> bool:
        return len(self.models) > 1

    # ---- start-up and the drain ------------------------------------------------------------------

    async def start(self) -> None:
        """Plan each model's KV cache, then load the models `preload` names, in order, while each fits beside
        those loaded before it (the others load when called). A single model's failure fails the start-up
        (raised); so does every model's."""
        self._plan()
        preload = self.settings.preload
        chosen = self.models if preload == "all" else self.models[:1] if preload == "default" else []
        for model in chosen:
            if model.state == "failed":
                continue
            if self.several and not self._fits(model, self._footprint(model)):
                log.info("model %s is loaded on its first request: the memory budget holds the models before it",
                         model.name)
                continue
            await self._load_task(model)  # raises while starting when the only model fails
        if all(m.state == "failed" for m in self.models):
            raise RuntimeError("no model could be loaded: " + "; ".join(f"{m.name}: {m.failure}" for m in self.models))
        self._starting = False
        if self.settings.keep_alive_s:
            self._watch = asyncio.create_task(self._unload_idle())

    async def close(self) -> None:
        """No more loads or unloads (the drain): the idle watch stops; a load under way is let finish."""
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    # ---- calls ---------------------------------------------------------------------------------

    async def acquire(self, model: ModelContext) -> AsyncEngine:
        """`model`'s engine, held for the caller until `release`: loaded first if it is not (the caller waits
        for it); Unavailable naming why when it failed to load."""
        while True:
            if model.state == "serving" and model.engine is not None:
                model.holders += 1
                model.last_used = time.monotonic()
                return model.engine
            if model.state == "failed":
                return model.ready()  # raises, naming why
            if self._closed:
                raise NotReady(f"the model {model.name!r} is not loaded and the server is draining")
            await self._load_task(model)

    def release(self, model: ModelContext) -> None:
        model.holders -= 1
        model.last_used = time.monotonic()
        if model.holders == 0:
            task = asyncio.get_running_loop().create_task(self._notify())
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)

    async def _notify(self) -> None:
        async with self._released:
            self._released.notify_all()

    # ---- the admin endpoints -------------------------------------------------------------------

    async def load(self, model: ModelContext) -> None:
        """Load `model` now (a failed one is tried again); Unavailable naming why when it cannot load."""
        if model.state == "failed":
            model.state, model.failure = "unloaded", ""
        await self.acquire(model)
        self.release(model)

    async def unload(self, model: ModelContext) -> None:
        """Unload `model` once the calls holding it are over; calls that arrive meanwhile wait and load it
        again."""
        async with self._lock:
            if model.state != "serving":
                return
            model.state = "unloading"
            async with self._released:
                await self._released.wait_for(lambda: model.holders == 0)
            await self._unload(model, "asked to")

    # ---- loading and unloading ---------------------------------------------------------------

    def _load_task(self, model: ModelContext) -> Awaitable[None]:
        """The load of `model` under way, or a new one; awaiting it never cancels it (other calls wait on it)."""
        task = self._loading.get(model.name)
        if task is None or task.done():
            task = self._loading[model.name] = asyncio.create_task(self._load(model))
        return asyncio.shield(task)

    async def _load(self, model: ModelContext) -> None:
        async with self._lock:
            if self.several and model.name not in self.kv_bytes:
                self._plan()  # a model whose bundle could not be read when the others were planned
            if model.state in ("serving", "failed"):
                return
            model.state = "loading"
            started = time.monotonic()
            try:
                footprint = self._footprint(model)
                await self._make_room(model, footprint)
                engine = await self.loader.load(model, self.kv_bytes.get(model.name),
                                                lambda what: self.status(what.format(self._called(model))))
            except Exception as e:
                if not self.several and self._starting:
                    model.fail(str(e) or type(e).__name__)
                    raise
                log.error("model %s (bundle %s) failed to load, the others serve on: %s", model.name, model.bundle, e)
                model.fail(str(e) or type(e).__name__)
                return
            model.attach(engine)
            model.footprint = self._footprint(model)  # now of the graph it serves
            model.loads += 1
            model.load_seconds = time.monotonic() - started
            model.last_used = time.monotonic()
            log.info("model %s loaded in %.1f s (%s graph; %.0f MiB of the budget, %.0f MiB left)", model.name,
                     model.load_seconds, model.graph, model.footprint / MiB, self._free() / MiB)

    async def _make_room(self, model: ModelContext, footprint: int) -> None:
        """Unload idle models, least recently used first, until `model` fits; wait for a busy one to be let go
        when none is idle. ValueError when it could not fit even alone."""
        alone = self.budget - self.held - MARGIN_BYTES
        if self.several and footprint > alone:
            raise ValueError(f"it needs {footprint / MiB:.0f} MiB (weights, largest step and KV cache) and the memory "
                             f"budget leaves {alone / MiB:.0f} MiB for models; raise memory_budget (--memory-budget) "
                             "or lower its max_context or kv_cache_bytes")
        while not self._fits(model, footprint):
            idle = sorted((m for m in self._loaded() if m.holders == 0), key=lambda m: m.last_used)
            if idle:
                await self._unload(idle[0], f"to make room for {model.name}")
                continue
            self.status(f"loading {model.name}: waiting for a loaded model to be idle, to make room")
            async with self._released:
                await self._released.wait_for(lambda: any(m.holders == 0 for m in self._loaded()))

    async def _unload(self, model: ModelContext, why: str) -> None:
        """Shut `model`'s engine down (no call holds it) and give its memory back."""
        model.state = "unloading"
        engine = model.detach()
        if engine is not None:
            await engine.shutdown()
        del engine
        return_freed_memory()
        log.info("model %s unloaded (%s); %.0f MiB of the budget free", model.name, why, self._free() / MiB)

    async def _unload_idle(self) -> None:
        """Unload the models idle for `keep_alive_s`, until the drain."""
        keep = self.settings.keep_alive_s
        while True:
            await asyncio.sleep(min(IDLE_CHECK_S, keep / 4))
            now = time.monotonic()
            for model in self._loaded():
                if model.holders == 0 and now - model.last_used >= keep and not self._lock.locked():
                    async with self._lock:
                        if model.state == "serving" and model.holders == 0:
                            await self._unload(model, f"idle for {keep:g} s")

    # ---- the budget ------------------------------------------------------------------------------

    def _plan(self) -> None:
        """Each model's KV cache, sized for all of them at once (`kv_shares`), before any loads; a model planned
        before keeps its size. A bundle that cannot be read fails its model. A model served alone plans its
        own from what the budget leaves once it is loaded."""
        if not self.several:
            return
        readable, specs = [], []
        for model in self.models:
            try:
                specs.append((read_manifest(model.bundle).model, self.loader.weight_bytes(model)))
                readable.append(model)
            except (BundleError, OSError) as e:
                if model.state != "failed":
                    log.error("model %s (bundle %s) cannot be served, the others serve on: %s", model.name,
                              model.bundle, e)
                    model.fail(f"its bundle {model.bundle} cannot be read: {e}")
        for model, kv in zip(readable, kv_shares(self.settings.engine_config(), specs, self.held), strict=True):
            self.kv_bytes.setdefault(model.name, kv)

    def _footprint(self, model: ModelContext) -> int:
        """What `model` takes of the budget once loaded: its weights, its largest step and its KV cache."""
        if not self.several:
            return 0
        spec = read_manifest(model.bundle).model
        config = self.settings.engine_config(model.bundle)
        return (self.loader.weight_bytes(model) + activation_bytes(spec, served_context(config, spec.n_ctx), config)
                + (self.kv_bytes.get(model.name) or 0))

    def _called(self, model: ModelContext) -> str:
        """How the log names `model`: by name among several."""
        return model.name if self.several else "the model"

    def _loaded(self) -> list[ModelContext]:
        return [m for m in self.models if m.state == "serving"]

    def _free(self) -> int:
        return self.budget - self.held - MARGIN_BYTES - sum(m.footprint for m in self._loaded())

    def _fits(self, model: ModelContext, footprint: int) -> bool:
        loaded = [m for m in self._loaded() if m is not model]
        most = self.settings.max_loaded_models
        return (not self.several or footprint <= self._free()) and not (most and len(loaded) >= most)
