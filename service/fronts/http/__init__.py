"""The HTTP front: OpenAI's API (completions, chat completions, models), Anthropic's Messages API and /health,
on the engine.

    app.py               the Starlette application: the endpoints and their answers
    request_body.py      a request's body read within its limits, parsed, bounded and validated; its deadline header
    errors.py            errors in OpenAI's shape, and the engine's field names as OpenAI's request spells them
    bearer_guard.py      the bearer-token check, before the application reads a request
    openai_schema.py     the request bodies (types only; ranges are the engine's, via fronts/validation.py)
    openai_responses.py  engine events -> OpenAI's response bodies and server-sent-event chunks
    anthropic_messages.py  the Messages API's endpoints: a body served as the chat request it translates into
    anthropic_schema.py    the Messages request bodies, and their translation into a chat request
    anthropic_responses.py engine events -> Anthropic's Message and its event stream
    anthropic_errors.py    errors in Anthropic's shape, on the Messages API's paths
    response_streams.py  a body sent as server-sent events, or as JSON a choice at a time
    listener.py          uvicorn in the server's event loop, beside gRPC
    connections.py       connections as a bounded resource: a cap, deadlines to speak and to read
    json_body.py         request bodies as JSON, their size in arrays, objects and values bounded before parsing
"""
