"""nginx in front of a fleet of replicas, configured as users configure it.

    with Fleet(3, bundle) as fleet, Nginx(fleet) as nginx:
        ... nginx.grpc_address, nginx.http_url ...     # one port for gRPC, one for the HTTP API
        nginx.resent()                                 # ids of the requests it sent to more than one replica

deploy/nginx/attnserve.conf.template is rendered as the nginx image renders it (`render_template`: envsubst
of the ATTNSERVE_ variables only), with one `server` line per replica in the two upstream files it includes,
and served by the machine's nginx, or by Debian's package unpacked into a cache when the machine has none
(`nginx_binary`). Its access log records each request's id and every upstream it tried.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from bench.fleet import Fleet
from service.client.server_process import free_port

ROOT = Path(__file__).resolve().parents[1]
NGINX_TEMPLATE = ROOT / "deploy" / "nginx" / "attnserve.conf.template"
NGINX_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnserve" / "nginx"
FAIL_TIMEOUT_S = 2.0  # the template's fail_timeout: nginx's passive health-check interval
# A replica marked down takes requests again once its last failure is FAIL_TIMEOUT_S old. A rolling update that
# drains the next replica sooner than that after the new one is SERVING can leave nginx none it thinks is up
# (502, "no live upstreams"): it waits this long first, as a Deployment's minReadySeconds makes Kubernetes wait.
MIN_READY_S = FAIL_TIMEOUT_S + 1.0


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
