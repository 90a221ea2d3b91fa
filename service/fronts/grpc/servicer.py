"""The gRPC front: the TextGeneration servicer. Thin: it converts the protobuf request
(`protocol`), submits it to the engine (`service.engine.async_engine`) and sends the events back.
Every error becomes a status code in `service.fronts.status` alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from attnserve import __version__
from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from service import logs
from service.engine.errors import InvalidRequest, Overloaded
from service.fronts.call import Call
from service.fronts.generation import Generation
from service.fronts.grpc.protocol import GRPC_NAMES, Collector, StreamProgress, parse_request, stream_messages
from service.fronts.model_admin import described, load_model, unload_model
from service.fronts.model_context import ModelContext
from service.fronts.serving_context import ServingContext
from service.fronts.status import internal_detail, status_for
from service.fronts.validation import check_text_fits

log = logging.getLogger("attnserve.server")

OFF_LOOP_CHARS = 16384  # longer prompts and texts are tokenized in a worker thread
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name


class TextGenerationService(pb_grpc.TextGenerationServicer):
    def __init__(self, serving: ServingContext):
        self.serving = serving

    # ---- RPCs ----------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        async with self._generation(request, context, "Generate", whole=True) as (accepted, generation):
            collector = Collector(accepted, generation.model.texts)
            async for _, events in generation.events():
                collector.add(events)
            return collector.response(generation.streams[0].timing)

    async def GenerateStream(self, request: pb.GenerateRequest, context) -> None:
        async with self._generation(request, context, "GenerateStream") as (accepted, generation):
            sent, stream = StreamProgress(), generation.streams[0]
            async for _, events in generation.events():
                for msg in stream_messages(accepted, events, generation.model.texts, sent, stream.timing,
                                           last=stream.finished):
                    await self._write(context, msg)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        async with self._rpc(context, "Tokenize") as call:
            self.serving.ready()
            model = self.serving.resolve(request.model)
            await self.serving.take(model, call)
            facts = model.facts
            check_text_fits("text", request.text, facts)

            def tokenize() -> pb.TokenizeResponse:
                ids = facts.tokenizer.encode(request.text)
                return pb.TokenizeResponse(token_ids=ids, tokens=[model.texts(i) for i in ids])

            return await asyncio.to_thread(tokenize) if len(request.text) > OFF_LOOP_CHARS else tokenize()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        async with self._rpc(context, "GetModelInfo"):
            self.serving.ready()
            return self._model_info(self.serving.resolve(request.model))

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        async with self._rpc(context, "ListModels"):
            self.serving.ready()
            return pb.ListModelsResponse(models=[self._model_info(m) for m in self.serving.models.values()])

    async def LoadModel(self, request: pb.LoadModelRequest, context) -> pb.ModelInfo:
        async with self._rpc(context, "LoadModel"):
            return self._model_info(await load_model(self.serving, request.model))

    async def UnloadModel(self, request: pb.UnloadModelRequest, context) -> pb.ModelInfo:
        async with self._rpc(context, "UnloadModel"):
            return self._model_info(await unload_model(self.serving, request.model))

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.ServerInfo:
        async with self._rpc(context, "GetServerInfo"):
            info = pb.ServerInfo(uptime_seconds=time.monotonic() - self.serving.started, version=__version__)
            stats = self.serving.stats()  # summed over the models that serve
            info.MergeFrom(pb.ServerInfo(
                requests_running=sum(s.running_requests for s in stats),
                requests_waiting=sum(s.waiting_requests for s in stats), kv_slots=sum(s.kv_slots for s in stats),
                kv_free_slots=sum(s.kv_free_slots for s in stats), kv_free_tokens=sum(s.kv_free_tokens for s in stats),
                kv_tokens=sum(s.kv_tokens for s in stats), tokens_per_second=sum(s.tokens_per_s for s in stats)))
            return info

    # ---- plumbing ------------------------------------------------------------------------------

    def _model_info(self, model: ModelContext) -> pb.ModelInfo:
        """`model` as ModelInfo, loaded or not (graph, dtype and provider once it is)."""
        m, context = described(model, self.serving.settings)
        if m is None:
            return pb.ModelInfo(name=model.name, state=model.state)
        info = pb.ModelInfo(name=model.name, vocab_size=m.vocab_size, context_tokens=context,
                            eos_token_id=m.eos_token_id, architecture=m.architecture, attention_heads=m.n_head,
                            kv_heads=m.kv_heads, eos_token_ids=m.stop_ids, layers=m.n_layer, kind=m.kind,
                            decoder_start_token_id=m.decoder_start_token_id or 0,
                            encoder_layers=m.n_encoder_layer or 0, state=model.state, graph=model.graph or "")
        engine = model.engine
        if m.encoder_decoder:
            info.source_tokens = engine.limits.max_prompt_tokens if engine is not None else \
                self.serving.settings.max_source_tokens or m.n_src_ctx or 0
        if engine is not None and model.state == "serving":
            runner = engine.runner
            info.dtype, info.provider = runner.spec.dtype, runner.session.get_providers()[0]
        return info

    async def _write(self, context, message) -> None:
        """Send one stream message; a client that reads none of it within write_timeout_s ends the stream."""
        limit = self.serving.settings.write_timeout_s
        try:
            await asyncio.wait_for(context.write(message), limit)
        except TimeoutError:
            self.serving.metrics.connections_closed.labels("grpc", "write_timeout").inc()
            log.info("ending a stream whose client read nothing for %g s (write_timeout_s)", limit)
            raise asyncio.CancelledError from None
        except grpc.aio.InternalError:  # the call is over: the client cancelled or went away
            raise asyncio.CancelledError from None

    @contextlib.asynccontextmanager
    async def _rpc(self, context, method: str):
        """Every RPC runs inside this: request id for the logs, status accounting, errors to status codes."""
        logs.request_id.set("-")
        call = Call(self.serving, "grpc", method)
        code = grpc.StatusCode.OK
        try:
            yield call
        except asyncio.CancelledError:  # the client cancelled, went away, or its deadline passed
            code = _cancel_code(context)
            raise
        except GeneratorExit:  # a stream closed by grpc after the client went away
            code = grpc.StatusCode.CANCELLED
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            # a rule names a field as the engine does; the client is told the proto's name
            error = GRPC_NAMES.renamed(e) if isinstance(e, InvalidRequest) else e
            status = status_for(error, self.serving.retry_after_ms(call.model) if isinstance(e, Overloaded) else 0)
            code = status.code
            if status.is_bug:
                log.error("%s: %s", status.details, internal_detail(e), exc_info=e)
            elif call.admitted is None:  # refused before it reached the engine (requests that ran log in finished())
                log.info("%s %s: %s", method, code.name, status.details)
            await context.abort(status.code, status.details, status.trailing_metadata)
        finally:
            call.finished(code.name, code is grpc.StatusCode.OK)

    @contextlib.asynccontextmanager
    async def _generation(self, request: pb.GenerateRequest, context, method: str, whole: bool = False):
        """Validate, submit, and hand the request and its `Generation` to the RPC body, which reads the events
        with `Generation.events` as the HTTP front does; always frees the request's slots. `whole`: the body
        reads the events only once the request has ended."""
        async with self._rpc(context, method) as call:
            logs.request_id.set(request.request_id or "-")
            self.serving.admit_calls()  # refused while loading or draining, before any parsing
            model = self.serving.resolve(request.model)
            await self.serving.take(model, call)  # loaded if need be; one that does not serve is refused here
            facts = model.facts
            long = len(request.prompt) > OFF_LOOP_CHARS or len(request.prompt_token_ids) > OFF_LOOP_CHARS
            accepted = await asyncio.to_thread(parse_request, request, facts) if long else \
                parse_request(request, facts)
            logs.request_id.set(accepted.request_id)
            remaining = context.time_remaining()
            if remaining is not None:
                accepted.request.deadline = time.monotonic() + remaining
            generation = await Generation.start(self.serving, call, model, [accepted], whole)
            try:
                yield accepted, generation
            finally:
                generation.close()


def _cancel_code(context) -> grpc.StatusCode:
    with contextlib.suppress(Exception):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
