"""What loading a model is: its serving graph opened (chosen and self-checked, or as `cache_dir` remembers it),
its engine planned with the KV cache it is granted, warmed up and started, a few requests rehearsed; and
what its weights are expected to take before it loads.

    loader = ModelLoader(settings)
    engine = await loader.load(model, kv_bytes)   # on a loading thread; the event loop goes on serving
    loader.weight_bytes(model)                    # the served graph's files (before the first load: the largest)

When a model loads and unloads is the model pool's (service/fronts/model_pool.py); this module only does it.
Loading runs on a daemon thread of its own rather than in the loop's executor, which `asyncio.run` joins
before returning: a signal during start-up must not wait for onnxruntime's session creation or runs, which
nothing can interrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from service.engine.async_engine import AsyncEngine
from service.engine.core import Engine
from service.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from service.engine.step_turns import StepTurns
from service.fronts.model_context import ModelContext
from service.runtime.bundle import AUTO_GRAPH, Manifest, read_manifest
from service.runtime.graph_choice import open_serving_graph
from service.runtime.memory import return_freed_memory
from service.runtime.static_runner import StaticRunner
from service.settings import ServerSettings

log = logging.getLogger("attnserve.server")

LOADING_THREAD = "attnserve-loading"
T = TypeVar("T")


class ModelLoader:
    """Loads a model on the server's settings; `prebuilt` is an engine already built for the default model
    (tests), served on its first load instead of opening the bundle. `turns`: what the engines of several
    models share, to take turns at the cores (`step_turns`)."""

    def __init__(self, settings: ServerSettings, prebuilt: AsyncEngine | None = None, turns: StepTurns | None = None):
        self.settings = settings
        self._prebuilt = prebuilt
        self.turns = turns

    async def load(self, model: ModelContext, kv_bytes: int | None, status: Callable[[str], None] = lambda _: None
                   ) -> AsyncEngine:
        """`model`'s engine, started and warm; `kv_bytes`: its KV cache (None: whatever the budget leaves, the
        plan of a model served alone). `status` hears what loading is doing, for the start-up's log: a phrase
        whose `{}` is the model's name."""
        s = self.settings
        if self._prebuilt is not None and self._prebuilt.config.bundle == model.bundle:
            engine, self._prebuilt = self._prebuilt, None
        else:
            status("loading {} (its graph chosen and self-checked, or as the cache says)")
            runner = await in_loading_thread(lambda: self.open(model.bundle))
            return_freed_memory()  # what the self-check opened beside the served graph
            config = s.engine_config(model.bundle)
            engine = AsyncEngine(config, engine=Engine(config, runner, kv_bytes), turns=self.turns)
        try:
            if s.warmup:
                status("warming up {}")
                await in_loading_thread(engine.engine.warm_up)  # before the engine thread owns the engine
            engine.start()
            if s.warmup:
                status("rehearsing a few requests on {}")
                await rehearse(engine)
        except BaseException:
            await engine.shutdown()
            raise
        return engine

    def open(self, bundle: Path) -> StaticRunner:
        """`bundle`'s serving graph, opened through the cache of graph choices (`cache_dir`, `recheck`). With
        several models its threads do not spin while idle: they would take the cores from the other engines."""
        s, config = self.settings, self.settings.engine_config(bundle)
        return open_serving_graph(config.bundle, config.graph, config.providers, config.threads, config.max_running,
                                  config.allow_low_agreement, config.max_source_tokens, cache_dir=s.cache_dir,
                                  recheck=s.recheck, kv_dtype=config.kv_dtype, spin=len(s.bundle) == 1)

    def weight_bytes(self, model: ModelContext, manifest: Manifest | None = None) -> int:
        """What `model`'s weights take once loaded, counted as its graph's files (and its encoder's): the graph
        it serves once it has loaded; before, the one `graph` names, or under auto the largest it could serve."""
        manifest = manifest or read_manifest(model.bundle)
        graph = model.graph or (None if self.settings.graph == AUTO_GRAPH else self.settings.graph)
        names = [graph] if graph in manifest.graphs else \
            [name for name, spec in manifest.graphs.items() if spec.cache == "static"]
        return max((graph_file_bytes(model.bundle, manifest, name) for name in names), default=0)


def graph_file_bytes(bundle: Path, manifest: Manifest, graph: str) -> int:
    """The bytes of graph `graph`'s files in `bundle`: its ONNX file, its encoder's, and the weights kept
    beside each (ONNX external data, `<file>.data`)."""
    encoder = manifest.encoder_for(graph)
    total = 0
    for file in [manifest.graphs[graph].file] + ([encoder.file] if encoder is not None else []):
        for path in [bundle / file, *bundle.glob(glob.escape(file) + ".*")]:
            with contextlib.suppress(OSError):
                total += path.stat().st_size
    return total


async def in_loading_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a daemon thread of its own, awaited (`main` exits without joining it)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: object, error: BaseException | None) -> None:
        if done.done():  # the waiting was cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is exiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=LOADING_THREAD, daemon=True).start()
    return await done


async def rehearse(engine: AsyncEngine) -> None:
    """A few requests through the whole path, prefill and decode at a few batch sizes, so the first
    real requests do not pay for what runs once."""
    width = min(engine.max_running, 8)
    prompt = [1 % engine.model.vocab_size] * 4

    async def one(i: int) -> None:
        request = GenerationRequest(f"warmup-{uuid.uuid4().hex}", list(prompt), SamplingParams(seed=i),
                                    StoppingCriteria(max_new_tokens=2, ignore_eos=True))  # a prefill, a decode
        async for _ in engine.submit(request):
            pass

    await one(0)
    await asyncio.gather(*(one(i) for i in range(width)))
