"""`attnserve serve` in a child process: for the tests and benchmarks that must not share an interpreter
with the server they probe, and for a fleet of replicas.

    with ServerProcess(["--bundle", "models/shakespeare-onnx"]) as srv:    # started and SERVING
        Client(srv.address).generate("ROMEO:")                             # also srv.http_url, srv.metrics()
    # stopped: SIGTERM, the drain, the exit

The contract:
- Ports: gRPC `port`, HTTP `http_port` and `metrics_port` are picked free on 127.0.0.1 when it is made and
  passed after `args`, so they win over any in `args`. They are kept for its life: `start()` after `stop()`
  or `kill()` brings it back where its clients look for it, as a Deployment's new pod takes an old one's endpoint.
- `start()` returns once the gRPC health service says SERVING; it raises `RuntimeError` with the end of the
  log if the child exits first, and stops it and raises if it is not SERVING within `start_timeout_s`.
  `launch()` starts the child and returns at once, for whoever watches it load (`http_health()`: the status
  of `GET /health`, 503 while loading).
- `stop()` sends SIGTERM and waits for the drain and the exit; a child that outlasts `stop_timeout_s` is
  killed, and `stop()` then raises `RuntimeError`. `kill()` is SIGKILL, no drain.
- Each start writes the child's stdout and stderr (the server's log) to a file of its own in `log_dir`,
  `<name>.<n>.log`: `logs` lists them, `log()` reads the latest.
- The child is `python -m attnserve serve`, run from the folder that holds the `service` package this
  module came from: in a checkout, its root, so that the child runs the same code as the parent. Where
  PYTHONSAFEPATH keeps the working directory off sys.path, it runs the installed copy. `command` runs
  something else that takes `attnserve serve`'s flags and health service: a test's patched server
  (`[sys.executable, "-c", code]`), or `bench.noop_server`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from service.client.health_probe import check

ROOT = Path(__file__).resolve().parents[2]
SERVE = (sys.executable, "-m", "attnserve", "serve")
HOST = "127.0.0.1"
START_TIMEOUT_S = 180.0  # loading and warming a model on 2 busy cores, beside other test processes
STOP_TIMEOUT_S = 60.0  # the default grace period (20 s) for requests in flight, and the exit after it


def free_port() -> int:
    """A localhost port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def stop(proc: subprocess.Popen | None, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """SIGTERM a child and wait for its exit; kill it if it outlasts `timeout_s`. False if it had to be killed."""
    if proc is None or proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


class ServerProcess:
    """One server in a child process, on ports fixed for its whole life (see the module docstring)."""

    def __init__(self, args: Sequence[str] = (), *, command: Sequence[str] = SERVE, name: str = "attnserve",
                 env: Mapping[str, str] | None = None, log_dir: Path | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, stop_timeout_s: float = STOP_TIMEOUT_S):
        self.name = name
        self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.argv = [*command, *args, "--host", HOST, "--port", str(self.port), "--http-port", str(self.http_port),
                     "--metrics-port", str(self.metrics_port)]
        self.env = {**os.environ, **(env or {})}
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"{name}-server-"))
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.logs: list[Path] = []  # one per start
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """The gRPC front's host:port."""
        return f"{HOST}:{self.port}"

    @property
    def http_url(self) -> str:
        """The HTTP front's base URL."""
        return f"http://{HOST}:{self.http_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> ServerProcess:
        """Start the child, with a log of its own, and return at once."""
        path = self.log_dir / f"{self.name}.{len(self.logs) + 1}.log"
        self.logs.append(path)
        with path.open("w") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        return self

    def start(self) -> ServerProcess:
        """Start the child and wait until it is SERVING (see the module docstring for the failures)."""
        self.launch()
        path = self.logs[-1]
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting; the end of "
                                   f"its log ({path}):\n{self.log()[-4000:]}")
            if self.health() == "SERVING":
                return self
            time.sleep(0.1)
        stop(self.proc, self.stop_timeout_s)
        raise RuntimeError(f"{self.name} was not SERVING after {self.start_timeout_s:.0f} s; its log: {path}")

    def stop(self) -> float:
        """SIGTERM, then wait for the drain and the exit; returns how long that took (0 if it was not running)."""
        if not self.running:
            return 0.0
        started = time.monotonic()
        if not stop(self.proc, self.stop_timeout_s):
            raise RuntimeError(f"{self.name} did not exit {self.stop_timeout_s:.0f} s after SIGTERM and was killed; "
                               f"its log: {self.logs[-1]}")
        return time.monotonic() - started

    def kill(self) -> None:
        """SIGKILL: no drain."""
        if self.running:
            self.proc.kill()
            self.proc.wait()

    def wait(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Wait for the child to exit (after a signal the caller sent); its exit code."""
        return self.proc.wait(timeout=timeout_s)

    def log(self) -> str:
        """The latest start's log."""
        return self.logs[-1].read_text(errors="replace")

    def health(self) -> str:
        """What the gRPC health service says ("SERVING", "NOT_SERVING"), or the call's status code name."""
        try:
            return check(self.address, timeout_s=1.0)
        except grpc.RpcError as e:
            return e.code().name

    def http_health(self) -> int | None:
        """The status of the HTTP front's `GET /health` (200 serving, 503 loading or draining), or None while
        nothing answers on its port."""
        try:
            with urllib.request.urlopen(f"{self.http_url}/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def metrics(self) -> dict[str, float]:
        """Its counters and gauges, `name{labels}` -> value, from its own /metrics."""
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        return {key: float(value) for key, value in (line.rsplit(" ", 1) for line in lines
                                                      if line and not line.startswith("#"))}

    def summed(self, name: str) -> float:
        """A metric's series summed over their labels (a per-request series has one per model)."""
        return sum(value for key, value in self.metrics().items() if key == name or key.startswith(name + "{"))

    def metric(self, name: str, **labels: str) -> float:
        """One series' value (labels in the order the server writes them), 0 while it has none."""
        key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        return self.metrics().get(key, 0.0)

    def __enter__(self) -> ServerProcess:
        try:
            return self.start()
        except BaseException:
            with contextlib.suppress(RuntimeError):
                self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
