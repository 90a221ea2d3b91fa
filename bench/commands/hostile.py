"""`attnserve bench hostile`: what hostile clients cost everyone else.

    attnserve bench hostile [--bundle models/shakespeare-onnx] [--connections 10000]

Starts `attnserve serve` with its default limits and runs each probe of docs/security.md#limits against
it: idle connections far past the cap, a 4 MiB body of a million one-token prompts (as strings, as
lists of ids, as ids), JSON nested 100,000 deep, four concurrent `Tokenize` calls at their limit. While
each runs, a watcher asks `GET /health` (a new connection each time) and makes a one-token gRPC
`Generate`, over and over; the table gives each probe's answer, how long it took, and the watcher's
worst and median latencies. Then the server's memory (VmRSS) and its open file handles, before and after.
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2

from attnserve.arguments import HintingParser
from attnserve.v1 import generate_pb2 as pb
from attnserve.v1 import generate_pb2_grpc as pb_grpc
from bench.machine import RESULTS_DIR, describe, machine_line, publish
from service.client import build_request
from service.client.server_process import ServerProcess

BODY_BYTES = 4 * 2**20 - 64


class Watcher:
    def __init__(self, http_url: str, address: str):
        self.http_url, self.address = http_url, address
        self.health_ms: list[float] = []
        self.grpc_ms: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            while not self._stop.is_set():
                self._time(self.health_ms, self._health)
                self._time(self.grpc_ms, lambda: stub.Generate(build_request("Rom.", max_new_tokens=1), timeout=60))
                self._stop.wait(0.02)

    def _health(self) -> None:
        """GET /health on a new connection, in plain HTTP/1.1 (an HTTP client library's own set-up would
        cost more than the server's answer)."""
        host, port = self.http_url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(answer.split(b"\r\n", 1)[0].decode(errors="replace"))

    def _time(self, into: list[float], call) -> None:
        started = time.perf_counter()
        try:
            call()
        except Exception as e:  # noqa: BLE001 - reported in the table
            self.errors.append(repr(e)[:120])
        into.append(1000 * (time.perf_counter() - started))

    def summary(self) -> dict:
        def stats(xs: list[float]) -> dict:
            return {"n": len(xs), "median_ms": round(statistics.median(xs), 1) if xs else None,
                    "max_ms": round(max(xs), 1) if xs else None}
        return {"health": stats(self.health_ms), "grpc": stats(self.grpc_ms), "errors": self.errors[:3],
                "error_count": len(self.errors)}


def _filled(unit: bytes) -> bytes:
    count = (BODY_BYTES - 20) // len(unit)
    return b'{"prompt":[' + unit * (count - 1) + unit.rstrip(b",") + b'],"max_tokens":1}'


def _post(url: str, body: bytes) -> str:
    r = httpx2.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120)
    return f"{r.status_code} {r.json()['error']['message'][:90]}" if r.status_code != 200 else "200"


def _idle(port: int, count: int, hold_s: float) -> str:
    socks = []
    for _ in range(count):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError as e:
            return f"opened {len(socks)}, then {e}"
    time.sleep(hold_s)
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            closed += s.recv(65536) is not None
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    return f"{count} opened and held {hold_s:g} s; {closed} answered or closed by the server"


def _tokenize(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        try:
            stub.Tokenize(pb.TokenizeRequest(text="a" * 4_000_000), timeout=60)
            return "4,000,000 characters accepted"
        except grpc.RpcError as e:
            limit = int(e.details().split("the limit is ")[1].split()[0])
        text = ("To be, or not to be: that is the question. " * (limit // 40 + 1))[:limit]
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: stub.Tokenize(pb.TokenizeRequest(text=text), timeout=60), range(4)))
        return f"limit {limit} characters; 4 concurrent at it: {sum(len(r.token_ids) for r in replies)} tokens"


def _grpc_ids(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(prompt_token_ids=[1] * (BODY_BYTES - 64), truncate_prompt=True)
        try:
            pb_grpc.TextGenerationStub(channel).Generate(request, timeout=120)
            return "OK"
        except grpc.RpcError as e:
            return f"{e.code().name} {e.details()[:90]}"


def _process(pid: int) -> dict:
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return {"rss_mib": round(rss / 1024, 1), "file_handles": len(os.listdir(f"/proc/{pid}/fd"))}


def run(bundle: str, connections: int, hold_s: float) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < connections + 256:  # raise only: this process may hold more already
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, connections + 256), hard))
    with ServerProcess(["--bundle", bundle]) as srv:
        pid = srv.proc.pid
        url, address = srv.http_url, srv.address
        with Watcher(url, address) as quiet:
            time.sleep(3)
        probes = {
            "idle HTTP connections": lambda: _idle(srv.http_port, connections, hold_s),
            "idle gRPC connections": lambda: _idle(srv.port, connections, hold_s),
            "1,000,000 prompts as strings": lambda: _post(url, _filled(b'"a",')),
            "1,000,000 prompts as id lists": lambda: _post(url, _filled(b"[1],")),
            "2,000,000 token ids": lambda: _post(url, _filled(b"1,")),
            "4,000,000 token ids over gRPC (truncate_prompt)": lambda: _grpc_ids(address),
            "JSON 100,000 deep": lambda: _post(url, b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
            "4 concurrent Tokenize at the limit": lambda: _tokenize(address),
        }
        before = _process(pid)
        rows = [{"probe": "none (quiet server)", **quiet.summary()}]
        for name, probe in probes.items():
            with Watcher(url, address) as w:
                started = time.perf_counter()
                outcome = probe()
                took = time.perf_counter() - started
            rows.append({"probe": name, "outcome": outcome, "took_s": round(took, 2), **w.summary()})
        deadline = time.monotonic() + 30  # header_timeout_s (10 s) and more: what the probes left is closed
        while _process(pid)["file_handles"] > before["file_handles"] and time.monotonic() < deadline:
            time.sleep(0.5)
        after = _process(pid)
    return {"machine": describe(), "bundle": bundle, "connections": connections, "hold_s": hold_s, "rows": rows,
            "server_before": before, "server_after": after}


def markdown(result: dict) -> str:
    command = f"attnserve bench hostile --connections {result['connections']} --hold-s {result['hold_s']:g}"
    lines = ["## Hostile clients", "", f"`{command}` on {machine_line(result['machine'])}; "
             f"`attnserve serve` with its default limits on `{Path(result['bundle']).name}`.", "",
             "| probe | answer | took | `/health` median / worst | gRPC `Generate` median / worst | watcher errors |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        h, g = r["health"], r["grpc"]
        took = f"{r['took_s']} s" if "took_s" in r else ""
        lines.append(f"| {r['probe']} | {r.get('outcome', '')} | {took} | {h['median_ms']} / "
                     f"{h['max_ms']} ms | {g['median_ms']} / {g['max_ms']} ms | {r['error_count']} |")
    b, a = result["server_before"], result["server_after"]
    lines += ["", f"Server before the probes: {b['rss_mib']} MiB resident, {b['file_handles']} file handles; "
                  f"after: {a['rss_mib']} MiB, {a['file_handles']}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = HintingParser(prog="attnserve bench hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default="models/shakespeare-onnx")
    p.add_argument("--connections", type=int, default=10_000, help="idle connections each connection probe opens")
    p.add_argument("--hold-s", type=float, default=15.0, help="how long they are held")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    result = run(args.bundle, args.connections, args.hold_s)
    text = markdown(result)
    print(text)
    publish("hostile", result, text, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
