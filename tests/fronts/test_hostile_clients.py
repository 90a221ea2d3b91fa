"""Hostile and broken clients (docs/security.md#limits), against `attnserve serve` in its own process with
small limits. While each probe runs, a watcher makes normal calls on the other front and asks `/health`;
every one must answer within RESPONSIVE_S. After each probe, the server holds no slot, connection or
file handle it did not hold before, and its memory is back near where it was."""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx2  # the HTTP client the openai client brings
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from service.client import build_request
from service.client.server_process import ServerProcess
from tests.fronts.server_harness import ServerThread, free_port, settings, wait_until

RESPONSIVE_S = 1.0  # what a normal call, or /health, may take while a probe runs
CAP = 24
LIMITS = {"max_connections": CAP, "header_timeout_s": 2, "body_timeout_s": 2, "idle_timeout_s": 2,
          "write_timeout_s": 1, "max_running": 4, "max_waiting": 12, "max_batch_tokens": 64, "threads": 1}
RESERVE = 32  # service.fronts.http.connections.RESERVE
MEMORY_SLACK = 150 * 2**20

# the HTTP port's sockets get a small send buffer, so that an unread response backs up after a few KB
# rather than after the 4 MB the kernel would otherwise buffer
SERVER = textwrap.dedent("""
    import socket, sys
    from service.fronts.http import listener
    start = listener.HttpListener.start
    async def small_send_buffer(self):
        port = await start(self)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return port
    listener.HttpListener.start = small_send_buffer
    from service.server import main
    sys.exit(main(sys.argv[1:]))
""")


class Served(ServerProcess):
    """The server under probe, and what it holds, read from /proc."""

    def handles(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def http_health(self) -> int:
        return httpx2.get(self.http_url + "/health", timeout=RESPONSIVE_S).status_code


@pytest.fixture(scope="module")
def served(engine_bundle, tmp_path_factory):
    args = ["--bundle", str(engine_bundle), "--graph", "static"]
    for name, value in LIMITS.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    server = Served(args, command=[sys.executable, "-c", SERVER], log_dir=tmp_path_factory.mktemp("served"))
    with server:
        yield server
    assert "Traceback" not in server.log(), server.log()[-4000:]


@pytest.fixture
def clean(served):
    """The server's holdings before a probe; after it, everything comes back."""
    before = served.handles(), served.rss()
    yield
    handles, rss = before

    def settled() -> bool:
        return (served.metric("attnserve_requests_running") == 0 and served.metric("attnserve_requests_waiting") == 0
                and served.metric("attnserve_kv_cache_usage_ratio") == 0
                and served.metric("attnserve_http_connections") == 0
                and served.handles() <= handles)
    wait_until(settled, timeout=60, what="the server to hold no slot, connection or file handle")
    assert served.rss() < rss + MEMORY_SLACK, (served.rss(), rss)


@dataclass
class Watcher:
    """Normal calls on one front and GET /health (on a new connection each), over and over while a probe runs."""

    served: Served
    front: str  # "grpc" or "http": where the normal calls go
    failures: list[str] = field(default_factory=list)
    calls: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        channel = grpc.insecure_channel(self.served.address)
        stub = pb_grpc.TextGenerationStub(channel)
        while not self._stop.is_set():
            for name, call in (("health", self._health), (self.front, lambda: self._generate(stub))):
                started = time.monotonic()
                try:
                    call()
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    self.failures.append(f"{name} after {time.monotonic() - started:.2f} s: {e!r}"[:300])
                self.calls += 1
            self._stop.wait(0.05)
        channel.close()

    def _health(self) -> None:
        assert self.served.http_health() == 200

    def _generate(self, stub) -> None:
        if self.front == "grpc":
            stub.Generate(build_request("Rom.", max_new_tokens=2), timeout=RESPONSIVE_S)
        else:
            r = httpx2.post(self.served.http_url + "/v1/completions", json={"prompt": "Rom.", "max_tokens": 2},
                            timeout=RESPONSIVE_S)
            assert r.status_code == 200, r.text


@contextmanager
def watching(served: Served, front: str):
    watcher = Watcher(served, front)
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    wait_until(lambda: watcher.calls >= 2, timeout=30, what="the watcher's first calls")
    try:
        yield watcher
    finally:
        calls = watcher.calls
        wait_until(lambda: watcher.calls >= calls + 2, timeout=30, what="the watcher's calls during the probe")
        watcher._stop.set()
        thread.join(timeout=30)
    assert not watcher.failures, watcher.failures[:5]


def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (reading whatever it sent before)."""
    sock.setblocking(False)
    try:
        while data := sock.recv(65536):
            del data
        return True
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def read_response(sock: socket.socket, timeout: float = 30) -> tuple[int, dict]:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post(served: Served, body, path: str = "/v1/completions", **kwargs) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx2.post(served.http_url + path, content=content, headers={"content-type": "application/json"},
                       timeout=60, **kwargs)


# ---- connections ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_idle_and_slowloris_http_connections_up_to_the_cap_are_closed_while_health_answers(served, clean):
    closed_before = sum(served.metric("attnserve_connections_closed_total", protocol="http", reason=reason)
                        for reason in ("header_timeout", "evicted"))
    silent = [connect(served.http_port) for _ in range(CAP // 2)]
    dripping = [connect(served.http_port) for _ in range(CAP - CAP // 2)]
    wait_until(lambda: served.metric("attnserve_http_connections") >= CAP, timeout=30, what="the cap to be reached")
    with watching(served, "grpc"):
        deadline = time.monotonic() + 3 * LIMITS["header_timeout_s"]
        for byte in b"POST /v1/completions HTTP/1.1\r\nx-slow: " + b"a" * 200:
            if time.monotonic() > deadline:
                break
            for s in dripping:
                try:
                    s.send(bytes([byte]))
                except OSError:
                    pass
            time.sleep(0.1)
        wait_until(lambda: all(closed_by_server(s) for s in silent + dripping), timeout=30,
                   what="every idle and slow connection to be closed")
    closed = sum(served.metric("attnserve_connections_closed_total", protocol="http", reason=reason)
                 for reason in ("header_timeout", "evicted"))
    assert closed - closed_before >= CAP
    for s in silent + dripping:
        s.close()


@pytest.fixture(scope="module")
def tight(engine_bundle):
    """A server in this process whose HTTP cap is 4 and whose deadlines are far away: what happens at the
    cap depends on what the connections do, not on how fast the machine is."""
    s = settings(engine_bundle, http_port=free_port(), max_connections=4, header_timeout_s=120, body_timeout_s=120)
    with ServerThread(s) as srv:
        yield srv


def speaking(srv: ServerThread, count: int) -> list[socket.socket]:
    """Connections that have begun a request (and so are not silent), each seen by the server before the next opens."""
    guard = srv.server.http.guard
    wait_until(lambda: not guard.open, what="the connections of earlier tests to close")
    socks = []
    for _ in range(count):
        socks.append(connect(srv.server.http_port))
        socks[-1].sendall(b"POST /v1/completions HTTP/1.1\r\n")
        wait_until(lambda: len(guard.open) >= len(socks) and not guard.silent,
                   what="the server to take the connection and hear its request begin")
    return socks


def test_past_the_cap_silent_connections_give_way_to_one_that_speaks(tight):
    url = f"http://127.0.0.1:{tight.server.http_port}"
    evicted = tight.server.metrics.connections_closed.labels("http", "evicted")
    before = evicted._value.get()
    wait_until(lambda: not tight.server.http.guard.open, what="the connections of earlier tests to close")
    silent = [connect(tight.server.http_port) for _ in range(4)]
    try:
        wait_until(lambda: len(tight.server.http.guard.open) >= 4, what="the cap to fill")
        r = httpx2.post(url + "/v1/completions", json={"prompt": "Rom.", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert evicted._value.get() == before + 1
        assert sum(closed_by_server(s) for s in silent) == 1  # the oldest
    finally:
        for s in silent:
            s.close()


def test_past_the_cap_and_its_reserve_a_connection_gets_a_503_in_openai_shape(tight):
    port = tight.server.http_port
    held = speaking(tight, 4 + RESERVE)
    try:
        wait_until(lambda: len(tight.server.http.guard.open) >= 4 + RESERVE,
                   what="the cap and the reserve to fill")
        health = connect(port)
        health.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        status, body = read_response(health)
        assert status == 503
        assert body["error"]["code"] == "service_unavailable" and "max_connections" in body["error"]["message"]
    finally:
        for s in held:
            s.close()


def test_at_the_cap_health_is_answered_on_the_reserve(tight):
    port = tight.server.http_port
    held = speaking(tight, 4)
    try:
        wait_until(lambda: len(tight.server.http.guard.open) >= 4, what="the cap to fill")
        assert httpx2.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        r = httpx2.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    finally:
        for s in held:
            s.close()


@pytest.mark.slow
def test_idle_grpc_connections_up_to_the_cap_are_refused_beyond_and_closed_in_time(served, clean):
    early = grpc.insecure_channel(served.address)  # a client connected before the flood: one of the CAP
    health = health_pb2_grpc.HealthStub(early)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    handles = served.handles()
    held = [connect(served.port) for _ in range(CAP - 1)]
    try:
        wait_until(lambda: served.handles() >= handles + CAP - 1, timeout=10, what="the server to accept them")
        # within header_timeout_s: a new connection is refused at once, the early client keeps its answers
        with grpc.insecure_channel(served.address, options=[("grpc.use_local_subchannel_pool", 1)]) as late:
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(late).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=RESPONSIVE_S).status == \
            health_pb2.HealthCheckResponse.SERVING
        with watching(served, "http"):
            # connections that never finish their handshake are closed after header_timeout_s
            wait_until(lambda: all(closed_by_server(s) for s in held), timeout=30,
                       what="the silent gRPC connections to be closed")
        with grpc.insecure_channel(served.address) as later:
            pb_grpc.TextGenerationStub(later).Generate(build_request("Rom.", max_new_tokens=2), timeout=30)
    finally:
        early.close()
        for s in held:
            s.close()


def test_oversized_headers_and_malformed_requests_get_errors_in_openai_shape(served, clean):
    sock = connect(served.http_port)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000 + b"\r\n\r\n")
    status, body = read_response(sock)
    assert status == 431 and body["error"]["code"] == "request_header_fields_too_large"
    sock = connect(served.http_port)
    sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    status, body = read_response(sock)
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}


def test_a_body_that_stops_arriving_gets_408(served, clean):
    sock = connect(served.http_port)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 100\r\n\r\n{\"prompt\": ")
    status, body = read_response(sock)
    assert status == 408 and body["error"]["param"] == "body" and "body_timeout_s" in body["error"]["message"]


# ---- bodies ---------------------------------------------------------------------------------------

def _filled(unit: bytes, limit: int = 4 * 2**20 - 64) -> bytes:
    count = (limit - 20) // len(unit)
    return b'{"prompt":[' + unit * (count - 1) + unit.rstrip(b",") + b'],"max_tokens":1}'


@pytest.mark.slow
def test_a_body_at_the_size_limit_full_of_tiny_prompts_is_refused_at_once(served, clean):
    most = max(LIMITS["max_running"], LIMITS["max_waiting"])
    with watching(served, "grpc"):
        for unit, what in ((b'"a",', "JSON values"), (b"[1],", "JSON arrays and objects"), (b"1,", "JSON values")):
            r = post(served, _filled(unit))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "body" and what in error["message"]
            assert f"at most {most} prompts" in error["message"]
        fewer = post(served, {"prompt": ["a"] * 100_000, "max_tokens": 1})  # within the body's limits
        assert fewer.status_code == 400
        error = fewer.json()["error"]
        assert error["param"] == "prompt" and f"at most {most} can be admitted" in error["message"]
    just_over = post(served, {"prompt": ["Rom."] * (most + 1), "max_tokens": 1})
    assert just_over.status_code == 400 and just_over.json()["error"]["param"] == "prompt"
    at_limit = post(served, {"prompt": ["Rom."] * most, "max_tokens": 1})
    assert at_limit.status_code == 200 and len(at_limit.json()["choices"]) == most


def test_a_large_whole_response_comes_whole(served, clean):
    most = max(LIMITS["max_running"], LIMITS["max_waiting"])
    with watching(served, "grpc"):
        r = post(served, {"prompt": ["Rom."] * most, "max_tokens": 100, "ignore_eos": True, "logprobs": 20})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(most))
    assert all(len(c["logprobs"]["top_logprobs"]) == 100 for c in choices)


@pytest.mark.parametrize("depth", [65, 970, 100_000])
def test_deep_json_is_a_400_before_its_fields_are_read(served, clean, depth):
    body = b'{"prompt": "Rom.", "max_tokens": 1, "frobnicate": ' + b"[" * depth + b"]" * depth + b"}"
    r = post(served, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "body"
    shallow = post(served, b'{"prompt": "Rom.", "max_tokens": 1, "frobnicate": ' + b"[" * 60 + b"]" * 60 + b"}")
    assert shallow.json()["error"]["param"] == "frobnicate", shallow.text  # parsed; then refused by name


def test_brackets_and_commas_inside_strings_do_not_count(served, clean):
    text = "[{" * 20_000 + "," * 300_000  # more than either limit, all inside a string
    r = post(served, {"prompt": "Rom. [{,", "max_tokens": 1, "user": text})
    assert r.status_code == 200, r.text


# ---- gRPC ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["/attnserve.v1.TextGeneration/Generate",
                                    "/attnserve.v1.TextGeneration/GenerateStream",
                                    "/attnserve.v1.TextGeneration/Tokenize",
                                    "/grpc.health.v1.Health/Check"])
def test_a_malformed_protobuf_gets_invalid_argument(served, clean, method):
    with grpc.insecure_channel(served.address) as channel:
        kind = channel.unary_stream if method.endswith("Stream") else channel.unary_unary
        call = kind(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as error:
            result = call(b"\xff\xff\xff\xff\x0f", timeout=30)
            list(result) if method.endswith("Stream") else result
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid" in error.value.details() and "DecodeError" not in error.value.details()


def test_every_list_field_has_a_limit_on_both_fronts(served, clean):
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(build_request("Rom.", max_new_tokens=1, stop_token_ids=[1] * 257), timeout=30)
        assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "stop_token_ids" in error.value.details() and "256" in error.value.details()
        stub.Generate(build_request("Rom.", max_new_tokens=1, stop_token_ids=[1] * 256), timeout=30)
    r = post(served, {"prompt": "Rom.", "max_tokens": 1, "stop_token_ids": [1] * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    r = post(served, {"messages": [{"role": "user", "content": "a"}] * 1000, "max_tokens": 1},
             path="/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.slow
def test_concurrent_tokenize_at_its_limit_does_not_stall_the_other_front(served, clean):
    with grpc.insecure_channel(served.address) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.Tokenize(pb.TokenizeRequest(text="a" * 4_000_000), timeout=30)
        assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        limit = int(error.value.details().split("the limit is ")[1].split()[0])
        text = ("To be, or not to be: that is the question. " * (limit // 40 + 1))[:limit]
        with watching(served, "http"):
            calls = [stub.Tokenize.future(pb.TokenizeRequest(text=text), timeout=60) for _ in range(4)]
            replies = [call.result() for call in calls]
    assert all(len(r.token_ids) == len(r.tokens) > 0 for r in replies)


# ---- unread streams -------------------------------------------------------------------------------

@pytest.mark.slow
def test_an_sse_stream_nobody_reads_is_closed_and_its_slot_freed(served, clean):
    closed_before = served.metric("attnserve_connections_closed_total", protocol="http", reason="write_timeout")
    sock = connect(served.http_port, rcvbuf=4096)
    body = json.dumps({"prompt": "Rom.", "max_tokens": 120, "ignore_eos": True, "stream": True, "logprobs": 5}).encode()
    with watching(served, "grpc"):
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: served.metric("attnserve_connections_closed_total", protocol="http",
                                         reason="write_timeout") > closed_before, timeout=60,
                   what="the unread stream to be closed")
    sock.close()


@pytest.mark.slow
def test_a_grpc_stream_nobody_reads_is_ended_and_its_slot_freed(served, clean):
    closed_before = served.metric("attnserve_connections_closed_total", protocol="grpc", reason="write_timeout")
    # no BDP probing and a small lookahead: the client's transport buffers little of what it is not asked for
    channel = grpc.insecure_channel(served.address, options=[("grpc.http2.bdp_probe", 0),
                                                             ("grpc.http2.lookahead_bytes", 1024)])
    try:
        with watching(served, "http"):
            call = pb_grpc.TextGenerationStub(channel).GenerateStream(
                build_request("Rom.", max_new_tokens=120, n=LIMITS["max_running"], ignore_eos=True, logprobs=True,
                              top_logprobs=20), timeout=120)
            wait_until(lambda: served.metric("attnserve_connections_closed_total", protocol="grpc",
                                             reason="write_timeout") > closed_before, timeout=60,
                       what="the unread stream to be ended")
        call.cancel()
    finally:
        channel.close()
