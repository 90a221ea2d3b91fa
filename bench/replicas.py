"""Several `attnserve serve` replicas on loopback, and the balancers users put in front of them.

    with Fleet(3, bundle) as fleet, Nginx(fleet) as nginx:
        load = StreamLoad(fleet.grpc_target, clients=32, new_tokens=32)   # or nginx.grpc_address, or HttpLoad
        async with load.running():
            await fleet.roll()                                             # SIGTERM, wait, start again, one by one
        load.summary()

- `Replica`: one server in a child process, on ports fixed for its whole life, so that a replacement
  takes its place as a Deployment's new pod takes an old one's endpoint; its log and its metrics
  outlive it (`logs`, `log_records`).
- `Fleet`: the replicas, `grpc_target` for client-side round robin over all of them, `roll()` and `kill()`.
- `Nginx`: deploy/nginx/attnserve.conf.template rendered as the nginx image renders it, in front of the
  fleet, with Debian's nginx (unpacked from its package when the machine has none).
- `StreamLoad`, `HttpLoad`: clients that stream one request after another until told to stop, each
  request with its own id, each recorded (`Outcome`): when it was sent, its first token, its tokens, how it ended.

Retries are the client's: the gRPC clients use the shipped channel options (`channel_options`: the retry
policy, and round robin with health checks when they reach the replicas themselves); over HTTP, nginx's
`proxy_next_upstream`. A request counts as *retried* when a replica refused it (its id in that replica's log
as refused) and then it completed elsewhere, or when nginx sent it to more than one replica (its access log).
A call refused at a closed port or by a GOAWAY is sent again inside the gRPC channel, where no log sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx2

from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from bench.peers.protocol import percentile
from service.client.grpc_client import channel_options
from service.client.health_probe import check
from service.client.server_process import free_port

ROOT = Path(__file__).resolve().parents[1]
NGINX_TEMPLATE = ROOT / "deploy" / "nginx" / "attnserve.conf.template"
NGINX_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnserve" / "nginx"
FAIL_TIMEOUT_S = 2.0  # the template's fail_timeout: nginx's passive health-check interval
START_TIMEOUT_S = 180.0


# ---- replicas ------------------------------------------------------------------------------------

class Replica:
    """One `attnserve serve` in a child process, on its own fixed gRPC, HTTP and metrics ports."""

    def __init__(self, name: str, args: list[str], workdir: Path):
        self.name = name
        self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port), "--http-port", str(self.http_port),
                     "--metrics-port", str(self.metrics_port), "--log-format", "json"]
        self.workdir = workdir
        self.generation = 0  # how many times it was started
        self.proc: subprocess.Popen | None = None
        self.logs: list[Path] = []  # one per start

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.generation += 1
        path = self.workdir / f"{self.name}.{self.generation}.log"
        self.logs.append(path)
        with path.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "attnserve.cli", "serve", *self.args], cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited with {self.proc.returncode} while starting:\n"
                                   + self.logs[-1].read_text()[-3000:])
            with contextlib.suppress(grpc.RpcError):
                if check(self.address, timeout_s=1.0) == "SERVING":
                    return
            time.sleep(0.1)
        raise RuntimeError(f"replica {self.name} was not SERVING after {timeout_s:.0f} s; log: {self.logs[-1]}")

    def health(self) -> str:
        try:
            return check(self.address, timeout_s=1.0)
        except grpc.RpcError as e:
            return e.code().name

    def metrics(self) -> dict[str, float]:
        """Its counters and gauges, `name{labels}` -> value, from its own /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {k: float(v) for k, v in re.findall(r"^(\S+) (\S+)$", text, re.M)}

    def terminate(self, timeout_s: float = 60.0) -> float:
        """SIGTERM, then wait for the drain to end; returns how long it took."""
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"replica {self.name} did not exit {timeout_s:.0f} s after SIGTERM") from None
        return time.monotonic() - t

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def log_records(self) -> list[dict]:
        """Every JSON log line of every life of this replica."""
        records = []
        for path in self.logs:
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
        return records


class Fleet:
    """`count` replicas of one bundle. `args`: more `attnserve serve` options for each."""

    def __init__(self, count: int, bundle: Path | str, args: list[str] = (), workdir: Path | None = None):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="attnserve-fleet-"))
        self.replicas = [Replica(f"r{i}", ["--bundle", str(bundle), *args], self.workdir) for i in range(count)]

    @property
    def grpc_target(self) -> str:
        """Every replica's address, for a channel's round robin: what a headless Service's DNS name resolves to."""
        return "ipv4:" + ",".join(r.address for r in self.replicas)

    def __enter__(self) -> Fleet:
        try:
            for r in self.replicas:  # one at a time: on 2 cores, loading them together is no faster
                r.start()
                r.wait_serving()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                with contextlib.suppress(RuntimeError):
                    r.terminate()

    async def roll(self, on_step=None) -> list[dict]:
        """Replace the replicas one at a time, as a rolling update with maxSurge 0 does: SIGTERM, wait for
        the drain and the exit, start the new one on the same ports, wait until it is SERVING."""
        steps = []
        for r in self.replicas:
            t = time.monotonic()
            drain_s = await asyncio.to_thread(r.terminate)
            await asyncio.to_thread(r.start)
            await asyncio.to_thread(r.wait_serving)
            steps.append({"replica": r.name, "drain_s": drain_s, "replaced_s": time.monotonic() - t})
            if on_step:
                on_step(steps[-1])
        return steps

    def refusals(self) -> set[str]:
        """Ids of the requests some replica refused (UNAVAILABLE or 503) before they started: each was sent again."""
        refused = set()
        for r in self.replicas:
            for rec in r.log_records():
                message = rec.get("message", "")
                if "draining" in message or "still loading" in message:
                    rid = rec.get("request_id")
                    if rid and rid != "-":
                        refused.add(rid)
        return refused

    def shares(self, before: dict[str, dict[str, float]], method: str) -> dict[str, float]:
        """Each replica's share of the calls to `method` since `before` (from `counts()`), from its own metrics."""
        now = self.counts(method)
        done = {name: now[name] - before.get(name, 0.0) for name in now}
        total = sum(done.values()) or 1.0
        return {name: n / total for name, n in done.items()}

    def counts(self, method: str) -> dict[str, float]:
        """Finished calls to `method` (an RPC, or an HTTP path) by replica, read from each one's /metrics."""
        out = {}
        for r in self.replicas:
            out[r.name] = sum(v for k, v in r.metrics().items()
                              if k.startswith("attnserve_requests_total{") and f'method="{method}"' in k)
        return out


# ---- nginx ---------------------------------------------------------------------------------------

def nginx_binary() -> Path:
    """nginx from the machine, or else Debian's package unpacked into a cache (no root needed, no service started)."""
    for found in (shutil.which("nginx"), "/usr/sbin/nginx", NGINX_CACHE / "usr" / "sbin" / "nginx"):
        if found and Path(found).is_file() and os.access(found, os.X_OK):
            return Path(found)
    if not shutil.which("apt-get"):
        raise RuntimeError("nginx is not installed and apt-get is not here to fetch Debian's package")
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(["apt-get", "download", "nginx"], cwd=tmp, capture_output=True, text=True)
        if got.returncode and os.geteuid() == 0:  # the package lists may never have been fetched
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
            got = subprocess.run(["apt-get", "download", "nginx"], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("nginx_*.deb"))
        if got.returncode or not debs:
            raise RuntimeError(f"apt-get download nginx failed: {got.stderr.strip()[-500:]}")
        NGINX_CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg", "-x", str(debs[0]), str(NGINX_CACHE)], check=True)
    return NGINX_CACHE / "usr" / "sbin" / "nginx"


def render_template(text: str, values: dict[str, str]) -> str:
    """envsubst as the nginx image runs it: only the named ${VARIABLES}, nginx's own $variables untouched."""
    missing = set(re.findall(r"\$\{(ATTNSERVE_\w+)\}", text)) - set(values)
    if missing:
        raise KeyError(f"no value for {sorted(missing)}")
    return re.sub(r"\$\{(ATTNSERVE_\w+)\}", lambda m: values[m[1]], text)


MAIN_CONF = """\
{user}worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    log_format upstreams '$http_x_request_id $status "$upstream_addr" "$upstream_status" $request_time';
    access_log {dir}/access.log upstreams;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    include attnserve.conf;
}}
"""


class Nginx:
    """nginx in front of a fleet, configured by deploy/nginx/attnserve.conf.template."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.grpc_port, self.http_port = free_port(), free_port()
        self.dir = fleet.workdir / "nginx"
        self.proc: subprocess.Popen | None = None

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def write_config(self) -> Path:
        d = self.dir
        (d / "tmp").mkdir(parents=True, exist_ok=True)
        site = render_template(NGINX_TEMPLATE.read_text(), {"ATTNSERVE_GRPC_LISTEN": f"127.0.0.1:{self.grpc_port}",
                                                            "ATTNSERVE_HTTP_LISTEN": f"127.0.0.1:{self.http_port}"})
        (d / "attnserve.conf").write_text(site)
        for kind, port in (("grpc", "port"), ("http", "http_port")):
            (d / f"attnserve-{kind}-replicas.conf").write_text("".join(
                f"server 127.0.0.1:{getattr(r, port)} max_fails=1 fail_timeout={FAIL_TIMEOUT_S:g}s;\n"
                for r in self.fleet.replicas))
        user = "user root;\n" if os.geteuid() == 0 else ""  # as root, workers would switch to a user that may not exist
        (d / "nginx.conf").write_text(MAIN_CONF.format(user=user, dir=d))
        return d / "nginx.conf"

    def __enter__(self) -> Nginx:
        conf = self.write_config()
        binary = nginx_binary()
        test = subprocess.run([str(binary), "-t", "-p", str(self.dir), "-c", str(conf)], capture_output=True, text=True)
        if test.returncode:
            raise RuntimeError(f"nginx rejects the configuration:\n{test.stderr}")
        self.proc = subprocess.Popen([str(binary), "-p", str(self.dir), "-c", str(conf), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=(self.dir / "stderr.log").open("w"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.dir / 'stderr.log').read_text()}")
            if all(_listening(p) for p in (self.grpc_port, self.http_port)):
                return self
            time.sleep(0.05)
        raise RuntimeError("nginx did not listen within 30 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish what is in flight
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def resent(self) -> set[str]:
        """Ids (X-Request-Id) of the requests nginx sent to more than one replica (its access log's upstream list)."""
        log = self.dir / "access.log"
        lines = log.read_text().splitlines() if log.exists() else []
        return {line.split(" ", 1)[0] for line in lines if "," in line.split('"')[1]}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---- load ----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One request as its client saw it."""
    request_id: str
    sent: float
    phase: str  # what the fleet was doing when it was sent ("steady", "roll", ...); "first" for a client's first
    first_token: float | None = None
    tokens: int = 0
    code: str = ""  # "OK", a gRPC status name, an HTTP status, or "HUNG" (no end by its deadline)
    ended: float = 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


@dataclass
class LoadSummary:
    sent: int
    completed: int  # OK with every token it asked for
    failed: dict[str, int]  # how the others ended
    short: int  # OK but fewer tokens than asked: never expected
    retried: int  # refused by a replica, then completed
    ttft_p99_s: dict[str, float] = field(default_factory=dict)  # by phase
    ttft_p50_s: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0

    @property
    def lost(self) -> int:
        return self.sent - self.completed

    def to_dict(self) -> dict:
        return {**self.__dict__, "lost": self.lost}


class _Load:
    """Clients that each send one request after another until `stop()`; a request's id is `prefix-client-n`."""

    def __init__(self, clients: int = 32, new_tokens: int = 32, prompt_tokens: int = 8, deadline_s: float = 120.0,
                 prefix: str = "load"):
        self.clients, self.new_tokens, self.prompt_tokens = clients, new_tokens, prompt_tokens
        self.deadline_s = deadline_s
        self.prefix = prefix
        self.phase = "steady"
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._started = 0.0
        self._ended = 0.0

    def prompt(self, client: int, n: int) -> list[int]:
        return [(client * 31 + n * 7 + i) % 60 + 1 for i in range(self.prompt_tokens)]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[_Load]:
        """The clients run inside; on leaving, each finishes the request it is in, then stops."""
        await self.open()
        self._started = time.monotonic()
        tasks = [asyncio.create_task(self._client(c)) for c in range(self.clients)]
        try:
            yield self
        finally:
            self._stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._ended = time.monotonic()
            await self.close()

    async def _client(self, c: int) -> None:
        n = 0
        while not self._stop.is_set():
            # a client's first request opens its connections: not a steady-state figure
            outcome = Outcome(f"{self.prefix}-{c}-{n}", time.monotonic(), "first" if n == 0 else self.phase)
            self.outcomes.append(outcome)
            try:
                await asyncio.wait_for(self.one(c, n, outcome), self.deadline_s + 30)
            except TimeoutError:
                outcome.code = "HUNG"
            outcome.ended = time.monotonic()
            n += 1

    async def wait_for(self, condition, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("the load did not reach the expected state in time")
            await asyncio.sleep(0.05)

    def completed_count(self) -> int:
        return sum(1 for o in self.outcomes if o.code == "OK")

    def summary(self, refused: set[str] = frozenset()) -> LoadSummary:
        done = [o for o in self.outcomes if o.code]
        ok = [o for o in done if o.code == "OK" and o.tokens == self.new_tokens]
        failed = Counter(o.code for o in done if o.code != "OK")
        by_phase: dict[str, list[float]] = {}
        for o in done:
            if o.ttft is not None:
                by_phase.setdefault(o.phase, []).append(o.ttft)
        span = (max(o.ended for o in done) - self._started) if done else 0.0
        return LoadSummary(
            sent=len(done), completed=len(ok), failed=dict(failed),
            short=sum(1 for o in done if o.code == "OK" and o.tokens != self.new_tokens),
            retried=sum(1 for o in ok if o.request_id in refused),
            ttft_p99_s={k: percentile(v, 99) for k, v in by_phase.items()},
            ttft_p50_s={k: percentile(v, 50) for k, v in by_phase.items()},
            tokens_per_s=sum(o.tokens for o in ok) / span if span else 0.0)

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def one(self, c: int, n: int, outcome: Outcome) -> None:
        raise NotImplementedError


class StreamLoad(_Load):
    """gRPC `GenerateStream` clients, one channel each, with the shipped channel options (`round_robin` over
    every replica's address, or the plain ones through a proxy)."""

    def __init__(self, target: str, round_robin: bool = False, **kw):
        super().__init__(**kw)
        self.target, self.round_robin = target, round_robin
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[pb_grpc.TextGenerationStub] = []

    async def open(self) -> None:
        options = channel_options(self.round_robin)
        self.channels = [grpc.aio.insecure_channel(self.target, options=options) for _ in range(self.clients)]
        self.stubs = [pb_grpc.TextGenerationStub(ch) for ch in self.channels]
        await asyncio.gather(*(asyncio.wait_for(ch.channel_ready(), 60) for ch in self.channels))

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self.channels))

    async def one(self, c: int, n: int, outcome: Outcome) -> None:
        request = pb.GenerateRequest(
            prompt_token_ids=self.prompt(c, n), request_id=outcome.request_id,
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_new_tokens=self.new_tokens, ignore_eos=True))
        call = self.stubs[c].GenerateStream(request, timeout=self.deadline_s)
        try:
            async for msg in call:
                got = len(msg.token_ids)
                if got and outcome.first_token is None:
                    outcome.first_token = time.monotonic()
                outcome.tokens += got
            outcome.code = "OK"
        except grpc.aio.AioRpcError as e:
            outcome.code = e.code().name


class HttpLoad(_Load):
    """Streaming `POST /v1/completions` clients (server-sent events), one keep-alive connection each."""

    def __init__(self, base_url: str, **kw):
        super().__init__(**kw)
        self.base_url = base_url
        self.clients_http: list[httpx2.AsyncClient] = []

    async def open(self) -> None:
        limits = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
        self.clients_http = [httpx2.AsyncClient(base_url=self.base_url, limits=limits, timeout=self.deadline_s)
                             for _ in range(self.clients)]

    async def close(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients_http))

    async def one(self, c: int, n: int, outcome: Outcome) -> None:
        body = {"prompt": self.prompt(c, n), "max_tokens": self.new_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with self.clients_http[c].stream("POST", "/v1/completions", json=body,
                                                   headers={"X-Request-Id": outcome.request_id}) as r:
                if r.status_code != 200:
                    await r.aread()
                    outcome.code = str(r.status_code)
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        outcome.tokens = event["usage"]["completion_tokens"]
                    elif event.get("choices") and event["choices"][0].get("text") and outcome.first_token is None:
                        outcome.first_token = time.monotonic()
                outcome.code = "OK" if outcome.tokens else "NO_USAGE"
        except httpx2.HTTPError as e:
            outcome.code = type(e).__name__


# ---- what the tests and `attnserve bench replicas` run -------------------------------------------

PATHS = ("round_robin", "nginx_grpc", "nginx_http")  # how clients reach the fleet


def load_on(path: str, fleet: Fleet, nginx: Nginx, **kw) -> _Load:
    """Clients over `path`: the Python client's round robin over every replica, or gRPC or HTTP through nginx."""
    if path == "round_robin":
        return StreamLoad(fleet.grpc_target, round_robin=True, **kw)
    if path == "nginx_grpc":
        return StreamLoad(nginx.grpc_address, **kw)
    return HttpLoad(nginx.http_url, **kw)


def method_of(path: str) -> str:
    """The name a replica's metrics count `path`'s calls under."""
    return "/v1/completions" if path == "nginx_http" else "GenerateStream"

async def roll_under_load(fleet: Fleet, load: _Load, settle: int = 2) -> list[dict]:
    """The load runs; once `settle` requests per client are done, the fleet is rolled; the load runs on until
    `settle` more per client are done. Requests are labelled "steady", "roll" and "after" by when they were sent."""
    async with load.running():
        await load.wait_for(lambda: load.completed_count() >= settle * load.clients)
        load.phase = "roll"
        steps = await fleet.roll()
        load.phase = "after"
        done = load.completed_count()
        await load.wait_for(lambda: load.completed_count() >= done + settle * load.clients)
    return steps


async def kill_under_load(load: _Load, victim: Replica, settle: int = 1, after: int = 3) -> float:
    """SIGKILL `victim` while it sends at least two streams; returns when. Requests sent later are "after"."""
    async with load.running():
        await load.wait_for(lambda: load.completed_count() >= settle * load.clients)
        await load.wait_for(lambda: victim.metrics().get("attnserve_requests_running", 0) >= 2)
        killed_at = time.monotonic()
        await asyncio.to_thread(victim.kill)
        load.phase = "after"
        done = load.completed_count()
        await load.wait_for(lambda: load.completed_count() >= done + after * load.clients)
    return killed_at


async def capacity(fleet: Fleet, load: StreamLoad, warm: int = 1, measured: int = 4) -> dict:
    """Tokens/s and TTFT over a window of steady load: from when `warm` requests per client are done until
    `measured` more per client are; tokens of the requests that ended in the window, TTFT of those sent in it,
    and each replica's share of the calls that ended in it (from its metrics)."""
    async with load.running():
        await load.wait_for(lambda: load.completed_count() >= warm * load.clients)
        load.phase, start = "measured", time.monotonic()
        done, before = load.completed_count(), fleet.counts("GenerateStream")
        await load.wait_for(lambda: load.completed_count() >= done + measured * load.clients)
        end, shares = time.monotonic(), fleet.shares(before, "GenerateStream")
        load.phase = "tail"
    ended = [o for o in load.outcomes if o.code == "OK" and start <= o.ended <= end]
    ttfts = [o.ttft for o in load.outcomes if o.phase == "measured" and o.ttft is not None]
    return {"tokens_per_s": sum(o.tokens for o in ended) / (end - start), "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99), "requests": len(ended), "shares": shares,
            "errors": dict(Counter(o.code for o in load.outcomes if o.code not in ("OK", "")))}
