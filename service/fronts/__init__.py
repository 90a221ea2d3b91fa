"""The fronts: protocols in front of the one engine. What they share lives here.

    grpc/              the gRPC front: servicer, protobuf conversion, TLS and token interceptor
    http/              the HTTP front: OpenAI's and Anthropic's APIs on Starlette and uvicorn, in the same event loop
    serving_context.py the engine both fronts submit to, admission, the drain, the retry-after hint
    generation.py      one generation's engine streams, submitted together, read and freed however the call ends
    stream_cadence.py  how many tokens a stream message carries and how long it waits for them
    call.py            one call's request id, metrics and closing log line
    token_texts.py     each token's text for logprobs, as gRPC and as OpenAI name it
    draft_counts.py    a call's speculative decoding counts for its usage, summed over its sequences
    tool_calls.py      a chat request's tools: the format its template teaches, the calls read out, their grammar
    tool_formats/      one reader per tool-call format (hermes, llama3_json, phi4_json, pythonic)
    reasoning.py       a <think>…</think> section read apart from the answer
    chat_output.py     a chat choice's text -> reasoning, content and calls, whole or as it streams
    validation.py      one statement of every front-level rule (the engine's are GenerationRequest.validate's)
    field_names.py     the engine's field names as each front spells them, for its errors
    auth.py            the bearer token check and PEM reading
    status.py          engine errors -> each protocol's status codes, the one table
    metrics.py         Prometheus metrics, on their own port, labelled by protocol
    ports.py           a port that cannot be bound, named with the setting that changes it
    file_handles.py    the open-file limit raised for the connection caps, or the caps fitted to it
"""
