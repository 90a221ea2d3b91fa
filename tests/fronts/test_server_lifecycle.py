"""The server's life: the gRPC port closed until warm, SERVING, then a drain that lets streams finish.
The SIGTERM/SIGINT tests run `attnserve serve` as a real process."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import httpx2  # the HTTP client the openai client brings
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from service.client import Client, build_request
from service.client.server_process import ServerProcess
from tests.conftest import SHIPPED_BUNDLE
from tests.engine.harness import Gate
from tests.fronts.server_harness import ServerThread, engine_for, free_port, settings, slowed, wait_until

ROOT = Path(__file__).resolve().parents[2]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def reachable_health(address: str, service: str = "", draining: bool = False) -> int | None:
    """Its health status, or None while the port takes no calls: loading (the port is not open), or closed by a
    drain. A check that races a drain's closing is cancelled by the server's transport, or, when the closing
    listener took its connection and never served it, runs into its deadline."""
    refused = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    try:
        return health(address, service)
    except grpc.RpcError as e:
        assert e.code() in refused + ((grpc.StatusCode.DEADLINE_EXCEEDED,) if draining else ()), e
        return None


def draining(address: str) -> bool:
    """Whether health says NOT_SERVING, or the port takes no new calls."""
    return reachable_health(address, draining=True) in (NOT_SERVING, None)


def test_the_grpc_port_opens_only_once_warm_and_serving(engine_bundle):
    """While the model loads, the gRPC port takes no connection (a balancer that ignores health still cannot
    send it a call): health and generation are UNAVAILABLE. Once warm, it is SERVING from its first call."""
    port = free_port()
    s = settings(engine_bundle, warmup=True, port=port)
    gates = []
    engine = engine_for(s, lambda e: gates.append(Gate(e, at=1)))  # holds the warm-up's first decode
    with ServerThread(s, engine, start=False) as srv:
        starting = srv.start_async()
        gates[0].wait_reached_sync()
        address = f"127.0.0.1:{port}"
        assert reachable_health(address) is None
        with Client(address, timeout_s=30) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate("Rom.", max_new_tokens=2)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            gates[0].open()
            starting.result(30)
            assert srv.server.port == port
            assert health(address) == SERVING and health(address, "attnserve.v1.TextGeneration") == SERVING
            assert len(c.generate("Rom.", max_new_tokens=2, ignore_eos=True).completions[0].token_ids) == 2


def test_a_health_watch_hears_not_serving_as_the_drain_starts(engine_bundle):
    """A balancer that watches health (gRPC's client-side health checks) is told at once; new calls are then
    refused at the port while the stream in flight finishes."""
    s = settings(engine_bundle, warmup=False)
    with ServerThread(s, engine_for(s, slowed(0.01))) as srv, Client(srv.address, timeout_s=60) as c:
        watch = health_pb2_grpc.HealthStub(c.channel).Watch(
            health_pb2.HealthCheckRequest(service="attnserve.v1.TextGeneration"), timeout=60)
        assert next(watch).status == SERVING
        call = c.stub.GenerateStream(build_request("Rom.", max_new_tokens=80, ignore_eos=True, seed=1), timeout=60)
        first = next(call)
        stopped = srv.drain(grace_s=30)
        assert next(watch).status == NOT_SERVING
        assert draining(srv.address)
        rest = list(call)
        assert sum(len(m.token_ids) for m in [first, *rest]) == 80
        stopped.result(30)


def test_drain_finishes_streams_in_flight_and_refuses_new_work(engine_bundle):
    s = settings(engine_bundle, warmup=False)
    with ServerThread(s, engine_for(s, slowed(0.01))) as srv, Client(srv.address, timeout_s=60) as c:
        call = c.stub.GenerateStream(build_request("Rom.", max_new_tokens=80, ignore_eos=True, seed=1), timeout=60)
        first = next(call)
        stopped = srv.drain(grace_s=30)
        wait_until(lambda: draining(srv.address), what="health to flip")
        with pytest.raises(grpc.RpcError) as e:
            c.generate("Ham.", max_new_tokens=2)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        rest = list(call)
        assert sum(len(m.token_ids) for m in [first, *rest]) == 80
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        stopped.result(30)


def test_drain_ends_what_outlives_the_grace_period_with_an_error_on_both_fronts(engine_bundle):
    s = settings(engine_bundle, warmup=False, http_port=free_port())
    with ServerThread(s, engine_for(s, slowed(0.02))) as srv, Client(srv.address, timeout_s=60) as c, \
            httpx2.Client(base_url=srv.http_url, timeout=60) as h:
        call = c.stub.GenerateStream(build_request("Rom.", max_new_tokens=120, ignore_eos=True), timeout=60)
        next(call)
        body = {"prompt": "Ham.", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with h.stream("POST", "/v1/completions", json=body) as sse:
            events = sse.iter_lines()
            next(events)
            srv.drain(grace_s=0.1).result(30)
            http_rest = [line for line in events if line]
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "grace period" in e.value.details()
        assert http_rest[-1] == "data: [DONE]"
        error = json.loads(http_rest[-2][6:])["error"]
        assert error["type"] == "service_unavailable" and "grace period" in error["message"]
        engine = srv.server.engine.engine
        assert not engine.requests and engine.kv.free_slots == engine.kv.n_slots


# decode slowed so that running requests are still running when a test looks (40 tokens: 2 s), even
# on a loaded machine; SLOW_DECODE_S slows it more
SLOW_SERVER = textwrap.dedent("""
    import os, sys, time
    from service.runtime.static_runner import StaticRunner
    decode = StaticRunner.decode
    def slow(self, ids, positions):
        time.sleep(float(os.environ.get("SLOW_DECODE_S", "0.05")))
        return decode(self, ids, positions)
    StaticRunner.decode = slow
    from service.server import main
    sys.exit(main(sys.argv[1:]))
""")


def slow_server(bundle: Path, logs: Path, *extra: str, decode_s: float = 0.05) -> ServerProcess:
    """`attnserve serve` in its own process, each decode step `decode_s` slower. It serves the graph `static`:
    with `auto` on a bundle with INT8 graphs, start-up would time and self-check them with the slowed decode too."""
    return ServerProcess(["--bundle", str(bundle), "--graph", "static", "--max-running", "4", "--max-batch-tokens", "64",
                          "--threads", "1", *extra], command=[sys.executable, "-c", SLOW_SERVER],
                         env={"SLOW_DECODE_S": str(decode_s)}, log_dir=logs)


@pytest.mark.slow
def test_sigterm_drains_in_flight_streams_on_both_fronts_then_exits_0(engine_bundle, tmp_path):
    """A gRPC stream and an HTTP stream in flight when SIGTERM arrives: both finish whole, while new calls
    get UNAVAILABLE and 503, gRPC health is NOT_SERVING or closed and HTTP /health 503; then the process exits 0."""
    with slow_server(engine_bundle, tmp_path) as srv:
        address = srv.address
        with Client(address, timeout_s=60) as c, httpx2.Client(base_url=srv.http_url, timeout=60) as h:
            call = c.stub.GenerateStream(build_request("Rom.", max_new_tokens=100, ignore_eos=True), timeout=60)
            first = next(call)
            body = {"prompt": "Ham.", "max_tokens": 100, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with h.stream("POST", "/v1/completions", json=body) as sse:
                events = sse.iter_lines()
                next(events)
                srv.proc.send_signal(signal.SIGTERM)
                wait_until(lambda: draining(address), what="health to flip")
                with pytest.raises(grpc.RpcError) as e:
                    c.generate("Ham.", max_new_tokens=2)
                assert e.value.code() is grpc.StatusCode.UNAVAILABLE
                assert h.get("/health").status_code == 503
                assert h.post("/v1/completions", json={"prompt": "Mac."}).status_code == 503
                rest = list(call)
                http_rest = [line for line in events if line]
        assert sum(len(m.token_ids) for m in [first, *rest]) == 100
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 100
        assert http_rest[-1] == "data: [DONE]" and json.loads(http_rest[-2][6:])["usage"]["completion_tokens"] == 100
        assert srv.wait(30) == 0, srv.log()
        assert "draining" in srv.log() and "stopped" in srv.log()


@pytest.mark.slow
def test_sigterm_under_load_completes_every_accepted_stream(engine_bundle, tmp_path):
    """8 streams in flight (4 running, 4 queued) when SIGTERM arrives: all 8 finish whole, new calls
    get UNAVAILABLE, health is NOT_SERVING or closed, and the process exits 0 within the grace period."""
    with slow_server(engine_bundle, tmp_path, "--grace-period-s", "20") as srv:
        address = srv.address
        with Client(address, timeout_s=60) as c:
            calls = [c.stub.GenerateStream(build_request(f"Rom. {i}", max_new_tokens=40, ignore_eos=True), timeout=60)
                     for i in range(8)]
            # whichever four arrived first run; the others queue (the arrival order is the server's)
            wait_until(lambda: (lambda i: (i.requests_running, i.requests_waiting) == (4, 4))(c.server_info()),
                       what="four requests to run and four to queue")
            srv.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: draining(address), what="health to flip")
            with pytest.raises(grpc.RpcError) as e:
                c.generate("Ham.", max_new_tokens=2)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            results = [list(call) for call in calls]
        for msgs in results:
            assert sum(len(m.token_ids) for m in msgs) == 40 and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert srv.wait(30) == 0, srv.log()


@pytest.mark.slow
def test_a_second_signal_ends_the_drain_at_once_with_the_drains_error(engine_bundle, tmp_path):
    """SIGINT starts a drain with 600 s of grace; SIGINT again ends every request in flight at once, running or
    queued, on both fronts, with the error the end of the grace period gives (gRPC UNAVAILABLE; an HTTP error
    event, then [DONE]), says so in the log, and the process exits 0 long before the grace period is over.
    The gRPC calls go over a channel without retries, so that a queued call's ending is its own."""
    # 0.2 s a decode step: a 100-token stream runs for 20 s at least, so none finishes before the second signal
    # (and the start-up self-check, slowed too, takes about as long)
    with slow_server(engine_bundle, tmp_path, "--grace-period-s", "600", decode_s=0.2) as srv:
        address = srv.address
        with grpc.insecure_channel(address) as channel, httpx2.Client(base_url=srv.http_url, timeout=120) as h:
            stub = pb_grpc.TextGenerationStub(channel)
            body = {"prompt": "Ham.", "max_tokens": 100, "ignore_eos": True, "stream": True}
            with h.stream("POST", "/v1/completions", json=body) as sse:
                events = sse.iter_lines()
                next(events)
                running = [stub.GenerateStream(build_request(f"Rom. {i}", max_new_tokens=100, ignore_eos=True),
                                               timeout=120) for i in range(3)]
                for call in running:
                    next(call)
                queued = [stub.GenerateStream(build_request(f"Mac. {i}", max_new_tokens=100, ignore_eos=True),
                                              timeout=120) for i in range(2)]
                wait_until(lambda: (lambda i: (i.requests_running, i.requests_waiting) == (4, 2))(
                    stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)), what="four to run and two to queue")
                srv.proc.send_signal(signal.SIGINT)
                wait_until(lambda: draining(address), timeout=60,
                           what="the drain to start")
                srv.proc.send_signal(signal.SIGINT)
                http_rest = [line for line in events if line]
            endings = []
            for call in running + queued:
                with pytest.raises(grpc.RpcError) as e:
                    list(call)
                endings.append((e.value.code(), e.value.details()))
        returncode, err = srv.wait(60), srv.log()
    cut = "the server stopped before the request finished (a second SIGTERM or SIGINT cut its drain short)"
    assert endings == [(grpc.StatusCode.UNAVAILABLE, cut)] * 5
    assert http_rest[-1] == "data: [DONE]"
    error = json.loads(http_rest[-2][6:])["error"]
    assert (error["type"], error["message"]) == ("service_unavailable", cut)
    assert returncode == 0, err
    assert err.count("SIGINT received") == 1 and "second signal: stopping now, 6 request(s) cut off" in err
    assert "grace period over" not in err and "stopped" in err


@pytest.mark.slow
def test_sigint_on_an_idle_server_exits_0(engine_bundle, tmp_path):
    with slow_server(engine_bundle, tmp_path, "--log-format", "json") as srv:
        srv.proc.send_signal(signal.SIGINT)
        assert srv.wait(30) == 0, srv.log()
        assert srv.log().startswith("{") and '"message": "stopped"' in srv.log()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_loading_ends_the_process_without_waiting_for_the_loading(engine_bundle, tmp_path, sig):
    """SIGTERM or SIGINT while the model loads (its self-check, each decode step slowed to 0.2 s, so that loading
    lasts far longer than the test waits): the process stops without waiting for it, says so, and exits 0."""
    srv = slow_server(engine_bundle, tmp_path, "--cache-dir", str(tmp_path / "cache"), decode_s=0.2)
    srv.launch()
    try:
        wait_until(lambda: srv.http_health() == 503 and "loading the model" in srv.log(), timeout=60,
                   what="/health to answer 503 while loading")
        srv.proc.send_signal(sig)
        returncode = srv.wait(60)
    finally:
        srv.kill()
    log = srv.log()
    assert returncode == 0, log
    assert f"{sig.name} received while loading the model" in log and "stopping now, without serving" in log
    assert "stopped" in log and "draining" not in log and "gRPC on" not in log and "Traceback" not in log


@pytest.mark.slow
def test_a_restart_serves_the_graph_its_first_start_chose_without_measuring(tmp_path):
    """The shipped bundle's first start times its graphs and self-checks its pick, and caches the outcome; a
    restart on the same cache folder serves the same graph without measuring, and its log says so and where."""
    cache = tmp_path / "cache"
    srv = ServerProcess(["--bundle", str(SHIPPED_BUNDLE), "--threads", "1", "--no-warmup", "--cache-dir", str(cache)],
                        log_dir=tmp_path)
    with srv:
        pass
    with srv:
        pass
    first, again = (log.read_text() for log in srv.logs)
    served = re.search(r"serving (\S+) \(", first)[1]
    assert "self-check: graph" in first and f"graph choice: cached in {cache}" in first
    assert "self-check" not in again and f"serving {served} (" in again and "not checked again" in again
    assert f"cached in {cache}" in again and f"({served} graph): gRPC on" in again


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    code = ("import sys; from attnserve.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, "serve", "--http-port", "0", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env=env)


def test_start_up_fails_in_one_line_for_a_missing_bundle(tmp_path):
    out = serve("--bundle", str(tmp_path / "nothing"), "--port", "0", "--metrics-port", "0")
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "start-up failed" in errors[0] and "nothing" in errors[0]


def damage(bundle: Path, how: str) -> str:
    """Break a copy of a bundle in one way; returns a word the one-line cause must contain."""
    manifest = json.loads((bundle / "bundle.json").read_text())
    graph = bundle / manifest["graphs"][manifest["default_graph"]]["file"]
    if how == "truncated graph":
        graph.write_bytes(graph.read_bytes()[:4096])
        return graph.name
    if how == "corrupt manifest":
        (bundle / "bundle.json").write_text('{"format": "attnserve-onnx", "model": ')
        return "bundle.json"
    if how == "missing graph":
        graph.unlink()
        return graph.name
    if how == "mismatched tokenizer":
        from model.training.tokenizer import train_bpe

        train_bpe(["a different corpus, a different vocabulary"] * 4, vocab_size=270, min_frequency=1).save(
            str(bundle / manifest["tokenizer_file"]))
        return "tokenizer"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated graph", "corrupt manifest", "missing graph", "mismatched tokenizer"])
def test_start_up_fails_in_one_line_for_a_broken_bundle(engine_bundle, tmp_path, how):
    bundle = tmp_path / "bundle"
    shutil.copytree(engine_bundle, bundle)
    word = damage(bundle, how)
    out = serve("--bundle", str(bundle), "--port", "0", "--metrics-port", "0")
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "start-up failed" in errors[0] and word in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_start_up_refuses_a_graph_that_fails_the_self_check_in_one_line(wrong_int8_bundle):
    out = serve("--bundle", str(wrong_int8_bundle), "--graph", "static-int8", "--port", "0", "--metrics-port", "0")
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "start-up failed: graph 'static-int8'" in errors[0], out.stderr[-2000:]
    assert "--graph static" in errors[0] and "Traceback" not in out.stderr



@pytest.mark.parametrize("setting,what,zero", [("port", "gRPC", "any free port"), ("http_port", "HTTP", "no HTTP front"),
                                               ("metrics_port", "metrics", "no metrics server")])
def test_a_taken_port_stops_start_up_in_one_line_naming_its_setting(setting, what, zero):
    ports = {"port": "0", "http_port": "0", "metrics_port": "0"}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports[setting] = str(taken)
        out = serve("--bundle", str(ROOT / "no-bundle-needed"), "--port", ports["port"], "--http-port",
                    ports["http_port"], "--metrics-port", ports["metrics_port"])
    flag, env = "--" + setting.replace("_", "-"), "ATTNSERVE_" + setting.upper()
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, out.stderr[-2000:]
    assert errors[0].endswith(f"start-up failed: cannot bind the {what} port 127.0.0.1:{taken}: Address already in use; "
                              f"choose another with {flag} or {env} (0 = {zero})"), errors[0]
    assert "Traceback" not in out.stderr and "GRPC_VERBOSITY" not in out.stderr and "Failed to" not in out.stderr

def test_help_lists_every_setting_with_its_default():
    from service.settings import ServerSettings

    out = serve("--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for name in ServerSettings.model_fields:
        assert "--" + name.replace("_", "-") in text
        assert "ATTNSERVE_" + name.upper() in text
    assert "[default: 50051;" in text and "[default: 64;" in text
