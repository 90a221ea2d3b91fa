"""`ServerProcess`: `attnserve serve` in a child process, started until SERVING, stopped by SIGTERM (or killed
past its bound), back on the same ports when started again, a log per start."""

from __future__ import annotations

import signal
import sys
import textwrap

import pytest

from service.client import Client
from service.client.server_process import ServerProcess

# a server whose drain never ends: SIGTERM alone cannot stop it
ENDLESS_DRAIN = textwrap.dedent("""
    import asyncio, sys
    from service.server import Server, main
    async def endless(self, grace_s=None):
        await asyncio.Event().wait()
    Server.drain = endless
    sys.exit(main(sys.argv[1:]))
""")


def serve_args(bundle) -> list[str]:
    return ["--bundle", str(bundle), "--graph", "static", "--threads", "1", "--no-warmup"]


def test_it_serves_until_stopped_and_starts_again_on_the_same_ports(engine_bundle, tmp_path):
    srv = ServerProcess(serve_args(engine_bundle), log_dir=tmp_path)
    ports = (srv.port, srv.http_port, srv.metrics_port)
    with srv:
        assert srv.running and srv.health() == "SERVING"
        with Client(srv.address, timeout_s=60) as client:
            assert client.generate("Rom.", max_new_tokens=2, ignore_eos=True).completions[0].token_ids
        assert srv.metric("attnserve_requests_running") == 0 and srv.summed("attnserve_generated_tokens_total") >= 2
        assert srv.stop() >= 0 and not srv.running and srv.health() == "UNAVAILABLE"
        srv.start()
        assert (srv.port, srv.http_port, srv.metrics_port) == ports and srv.health() == "SERVING"
    assert not srv.running and srv.proc.returncode == 0
    assert srv.logs == [tmp_path / "attnserve.1.log", tmp_path / "attnserve.2.log"]
    assert all("stopped" in log.read_text() for log in srv.logs)


def test_a_child_that_exits_while_starting_is_reported_with_its_log(tmp_path):
    srv = ServerProcess(["--bundle", str(tmp_path / "nothing")], log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="exited with 1 while starting") as failed:
        srv.start()
    assert "start-up failed" in str(failed.value) and "nothing" in str(failed.value)


def test_a_child_that_outlasts_the_bound_after_sigterm_is_killed(engine_bundle, tmp_path):
    srv = ServerProcess(serve_args(engine_bundle), command=[sys.executable, "-c", ENDLESS_DRAIN], log_dir=tmp_path,
                        stop_timeout_s=2)
    srv.start()
    with pytest.raises(RuntimeError, match="did not exit 2 s after SIGTERM and was killed"):
        srv.stop()
    assert not srv.running and srv.proc.returncode == -signal.SIGKILL
