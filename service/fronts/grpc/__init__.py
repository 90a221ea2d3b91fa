"""The gRPC front (attnserve.v1.TextGeneration, health, reflection).

    servicer.py   the RPCs: protobuf in, the engine, protobuf out
    protocol.py   protobuf requests -> the engine's, engine events -> protobuf
    security.py   TLS credentials and the bearer-token interceptor
    decoding.py   malformed protobuf -> INVALID_ARGUMENT, on every method
    options.py    the port's channel arguments: message sizes, connection cap, handshake, idle, keepalive
"""
