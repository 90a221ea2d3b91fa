"""Requests that are not valid protobuf end with INVALID_ARGUMENT, naming the message type.

grpc decodes a request before any servicer code runs, and a decoding error would reach the client as
UNKNOWN with the name of a Python exception. `MalformedMessages` wraps every method's decoder so that a
malformed message becomes a marker, and the method then ends with INVALID_ARGUMENT before it starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

import grpc


class MalformedMessages(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _checked(handler)


class _Malformed:
    def __init__(self, what: str):
        self.details = f"the request is not a valid {what} message"


def _checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer
    message_type = getattr(getattr(decode, "__self__", None), "DESCRIPTOR", None)
    what = message_type.full_name if message_type is not None else "protobuf"

    def deserializer(data: bytes):
        try:
            return decode(data)
        except Exception:
            return _Malformed(what)

    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    behavior = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
                (True, False): handler.stream_unary, (True, True): handler.stream_stream}[(streaming_in, streaming_out)]
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[(streaming_in, streaming_out)]

    if not (inspect.isasyncgenfunction(behavior) or inspect.iscoroutinefunction(behavior)):
        return handler  # every method this server registers is async

    async def checked(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return request

    async def requests(iterator, context):
        async for request in iterator:
            yield await checked(request, context)

    if inspect.isasyncgenfunction(behavior):
        async def call(request_or_iterator, context):
            arg = requests(request_or_iterator, context) if streaming_in else await checked(request_or_iterator,
                                                                                             context)
            async for response in behavior(arg, context):
                yield response
    else:
        async def call(request_or_iterator, context):
            arg = requests(request_or_iterator, context) if streaming_in else await checked(request_or_iterator,
                                                                                             context)
            return await behavior(arg, context)

    return make(call, request_deserializer=deserializer, response_serializer=handler.response_serializer)
