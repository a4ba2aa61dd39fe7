"""Prometheus metrics of the rollout service, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 1800)


class RolloutMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("prorl_rollout_http_requests", "HTTP requests", ["route", "status"], registry=r)
        self.jobs = Counter(
            "prorl_rollout_jobs_finished", "Jobs finished", ["task", "state", "error_class"], registry=r
        )
        self.stage_seconds = Histogram(
            "prorl_rollout_stage_seconds", "Time per stage", ["stage"], buckets=_SECONDS, registry=r
        )
        self.reward = Histogram(
            "prorl_rollout_reward", "Reward of finished episodes", ["task"], buckets=(0, 0.25, 0.5, 0.75, 1), registry=r
        )
        self.in_flight = Gauge("prorl_rollout_jobs_in_flight", "Jobs not finished", ["state"], registry=r)
        self.policy_version = Gauge("prorl_rollout_policy_version", "Current policy version", registry=r)
        # Decoupled mode, set from the producer's figures at each scrape (totals since the service started).
        self.decoupled = Gauge(
            "prorl_rollout_decoupled",
            "Decoupled mode: upcoming, in_flight, leased, undelivered now; produced, filtered, retried, dropped, "
            "expired, redelivered, dead_letters since start",
            ["figure"],
            registry=r,
        )
        self.degraded = Gauge(
            "prorl_rollout_degraded", "1 while the buffer or the prompt queue cannot be used (see /healthz)", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
