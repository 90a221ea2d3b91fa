"""A server in a child process for a benchmark: `attnserve serve`, or the no-op server.

    with ServerProcess(["serve", "--bundle", "models/shakespeare-onnx"]) as srv:
        run_load(srv.address, ...)

It picks free ports (gRPC `address`, HTTP `http_url`), waits until the health service says SERVING, and
on exit sends SIGTERM and waits for the drain. The child's log goes to a file (`log_path`), not the benchmark's output.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from service.client.health_probe import check

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], module: str = "attnserve.cli", startup_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port()
        self.http_url = f"http://127.0.0.1:{self.http_port}"  # the HTTP front's base URL
        self.args = list(args)
        if module == "attnserve.cli":
            self.args += ["--host", "127.0.0.1", "--port", str(self.port), "--http-port", str(self.http_port),
                          "--metrics-port", str(free_port())]
        else:  # bench.noop_server
            self.args += ["--port", str(self.port), "--http-port", str(self.http_port)]
        self.module = module
        self.timeout = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix="attnserve-bench-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=ROOT, env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} while starting; its log:\n"
                                   + self.log_path.read_text()[-4000:])
            try:
                if check(self.address, timeout_s=1.0) == "SERVING":
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"the server was not SERVING after {self.timeout:.0f} s; log: {self.log_path}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __exit__(self, *exc) -> None:
        stop(self.proc)


def stop(proc: subprocess.Popen | None, grace_s: float = 30.0) -> None:
    """SIGTERM a child server and wait for its drain; kill it if it outlasts `grace_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
