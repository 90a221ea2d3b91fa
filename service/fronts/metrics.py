"""Prometheus metrics, served over HTTP on their own port (`metrics_port`) at /metrics.

Latency histograms and token counters are observed by each front as its requests progress (`call.Call`),
labelled with the request's `model`; the gauges and the engines' own counters (prefix cache, speculative
decoding) read the latest snapshot of every model's engine when Prometheus scrapes, summed over them, so they
cost nothing between scrapes. Each `Metrics` has its own registry, so several servers can live in one process
(tests do).
"""

from __future__ import annotations

import socket
import socketserver
import sys
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from service.engine.core import EngineStats
from service.fronts.ports import port_error

# 1 ms .. 60 s: a token step on a small model is ~1 ms, a long queue wait tens of seconds.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
METRICS_READ_TIMEOUT_S = 10  # a /metrics connection that sends nothing this long is closed


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "attnserve_time_to_first_token_seconds", "Arrival to first generated token", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram(
            "attnserve_inter_token_latency_seconds", "Time between consecutive tokens of one completion", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.request_duration = Histogram(
            "attnserve_request_duration_seconds", "Arrival to last token of requests that finished", ["model"],
            buckets=REQUEST_BUCKETS_S, registry=r)
        self.queue_duration = Histogram(
            "attnserve_queue_duration_seconds", "Arrival to start of prefill", ["model"], buckets=LATENCY_BUCKETS_S,
            registry=r)
        self.requests_running = Gauge("attnserve_requests_running", "Requests holding KV cache slots", registry=r)
        self.requests_waiting = Gauge("attnserve_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_cache_usage = Gauge("attnserve_kv_cache_usage_ratio", "Share of the KV cache's tokens held by "
                                    "running sequences (0..1; the prefix cache's blocks count as free)",
                                    registry=r)
        self.generated_tokens = Counter("attnserve_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.prompt_tokens = Counter("attnserve_prompt_tokens", "Prompt tokens of accepted requests", ["model"],
                                     registry=r)
        self.requests = Counter("attnserve_requests", "Finished calls by protocol (grpc, http), method (RPC or "
                                "path) and status (gRPC code name, HTTP status)", ["protocol", "method", "code"],
                                registry=r)
        self.http_connections = Gauge("attnserve_http_connections", "Open connections to the HTTP port", registry=r)
        self.connections_closed = Counter(
            "attnserve_connections_closed", "Connections (HTTP) or streams (gRPC) the server closed on a client that "
            "broke a limit, by protocol and reason (over_capacity, evicted, header_timeout, write_timeout)",
            ["protocol", "reason"], registry=r)
        self.prefix_cache_hit_rate = Gauge(
            "attnserve_prefix_cache_hit_rate", "Share of admitted prompt tokens found in the prefix cache since start "
            "(0..1)", registry=r)
        self._http: WSGIServer | None = None

    def watch(self, stats: Callable[[], list[EngineStats]]) -> None:
        """Read the gauges from `stats()`, each serving engine's snapshot, at scrape time (once, at start-up)."""
        self.requests_running.set_function(lambda: sum(s.running_requests for s in stats()))
        self.requests_waiting.set_function(lambda: sum(s.waiting_requests for s in stats()))
        self.kv_cache_usage.set_function(lambda: _usage(stats()))
        self.prefix_cache_hit_rate.set_function(lambda: _hit_rate(stats()))
        self.registry.register(_EngineCounters(stats))

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server on a daemon thread; returns the bound port."""
        server = type("MetricsServer", (_ThreadingServer,), {"address_family": socket.AF_INET6 if ":" in host
                                                             else socket.AF_INET})
        try:
            self._http = make_server(host, port, make_wsgi_app(self.registry), server, handler_class=_QuietHandler)
        except OSError as e:
            raise port_error("metrics_port", host, port, e) from None
        threading.Thread(target=self._http.serve_forever, name="attnserve-metrics", daemon=True).start()
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that timed out or went away is no news
            super().handle_error(request, client_address)


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_READ_TIMEOUT_S  # per read: an idle connection does not keep its thread for ever

    def log_message(self, format, *args) -> None:  # the server logs its own lines, not one per scrape
        pass


def _usage(stats: list[EngineStats]) -> float:
    tokens = sum(s.kv_tokens for s in stats)
    return 1.0 - sum(s.kv_free_tokens for s in stats) / tokens if tokens else 0.0


def _hit_rate(stats: list[EngineStats]) -> float:
    queried = sum(s.prefix_queried_tokens for s in stats)
    return sum(s.prefix_hit_tokens for s in stats) / queried if queried else 0.0


class _EngineCounters(Collector):
    """The engine's counters (prefix cache, speculative decoding), read from its snapshot at scrape time (for
    rate()); speculative decoding's stay 0 while it is off."""

    def __init__(self, stats: Callable[[], list[EngineStats]]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        spec = [s.speculation for s in stats]
        yield CounterMetricFamily("attnserve_prefix_cache_queried_tokens", "Prompt tokens of admitted requests "
                                  "looked up in the prefix cache", value=sum(s.prefix_queried_tokens for s in stats))
        yield CounterMetricFamily("attnserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache "
                                  "(keys and values copied, not computed)",
                                  value=sum(s.prefix_hit_tokens for s in stats))
        yield CounterMetricFamily("attnserve_preemptions", "Sequences preempted, to be prefilled again later, when the "
                                  "KV cache had no block free for them to grow",
                                  value=sum(s.preemptions for s in stats))
        yield CounterMetricFamily("attnserve_spec_decode_drafts", "Drafts speculative decoding had the model check "
                                  "(one per sequence and step)", value=sum(s.drafts for s in spec))
        yield CounterMetricFamily("attnserve_spec_decode_draft_tokens", "Draft tokens speculative decoding had the "
                                  "model check", value=sum(s.draft_tokens for s in spec))
        yield CounterMetricFamily("attnserve_spec_decode_accepted_tokens", "Draft tokens the model kept (emitted "
                                  "without a model call of their own)", value=sum(s.accepted_tokens for s in spec))
