"""The one shared live server: a real attnserve server on the engine bundle, gRPC and HTTP, started once
for the session, and clients of it. Tests that need other settings (limits, TLS, a fault in the engine)
start their own `ServerThread`."""

from __future__ import annotations

import pytest

from service.client import Client
from tests.fronts.server_harness import ServerThread, free_port, settings


@pytest.fixture(scope="session")
def server(engine_bundle):
    with ServerThread(settings(engine_bundle, metrics_port=free_port(), http_port=free_port())) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server):
    with Client(server.address, timeout_s=60) as c:
        yield c
