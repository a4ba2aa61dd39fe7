"""Prometheus metrics of one server, in a registry of its own (so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("prorl_sandbox_http_requests", "HTTP requests", ["route", "status"], registry=r)
        self.sandboxes_created = Counter("prorl_sandbox_created", "Sandboxes created", ["backend"], registry=r)
        self.sandboxes_deleted = Counter("prorl_sandbox_deleted", "Sandboxes deleted", ["backend"], registry=r)
        self.sandboxes_reaped = Counter("prorl_sandbox_reaped", "Sandboxes reaped", ["reason"], registry=r)
        self.exec_seconds = Histogram(
            "prorl_sandbox_exec_seconds", "Command duration", ["status"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.active = Gauge("prorl_sandbox_active", "Sandboxes alive now", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
