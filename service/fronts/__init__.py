"""The fronts: protocols in front of the one engine. What they share lives here.

    grpc/        the gRPC front: servicer, protobuf conversion, TLS and token interceptor
    validation.py  one statement of every request field's range, used by every front
    auth.py      the bearer token check and PEM reading
    status.py    engine errors -> protocol status codes, the one table
    metrics.py   Prometheus metrics, on their own port

An HTTP front belongs beside grpc/, as fronts/http/, on the same engine and the same shared modules.
"""
