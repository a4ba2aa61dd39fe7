"""Prometheus metrics of the rollout service, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..hooks.specs import hookimpl
from ..models import JobState, RunConcurrencyState, Trajectory

TAMPERED_ARTIFACT = "tampered"  # the artifact a task's eval sets when it found the grading tampered with
_SECONDS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 1800)


class RolloutMetrics:
    """The registry, and a plugin: the service registers it so that each finished job is counted."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("prorl_rollout_http_requests", "HTTP requests", ["route", "status"], registry=r)
        self.jobs = Counter(
            "prorl_rollout_jobs_finished", "Jobs finished", ["task", "state", "error_class"], registry=r
        )
        # A grading whose canary tests read wrong (the code under test rewrote the test runner): it scored 0, and
        # the trajectory's artifacts say why under TAMPERED_ARTIFACT.
        self.tampered = Counter(
            "prorl_rollout_tampered_gradings", "Gradings that found the test runner tampered with", ["task"], registry=r
        )
        self.stage_seconds = Histogram(
            "prorl_rollout_stage_seconds", "Time per stage", ["stage"], buckets=_SECONDS, registry=r
        )
        self.reward = Histogram(
            "prorl_rollout_reward", "Reward of finished episodes", ["task"], buckets=(0, 0.25, 0.5, 0.75, 1), registry=r
        )
        self.in_flight = Gauge("prorl_rollout_jobs_in_flight", "Jobs not finished", ["state"], registry=r)
        self.policy_version = Gauge("prorl_rollout_policy_version", "Current policy version", registry=r)
        # The weight-update barrier (weight_barrier.py), set from its state at each scrape.
        self.weight_update = Gauge(
            "prorl_rollout_weight_update",
            "The weight-update barrier here: paused (1/0), in_flight and waiting requests now; pauses, expired and "
            "held_seconds since start",
            ["figure"],
            registry=r,
        )
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
        self.warm = Counter(
            "prorl_rollout_warm_sandboxes",
            "Sandboxes asked for with --warm-sandboxes: hit (a warm one) or miss",
            ["outcome"],
            registry=r,
        )
        self._warm_counted = {"hit": 0, "miss": 0}
        # The run stage's limit (adaptive_concurrency.py), set at each scrape.
        self.run_limit = Gauge(
            "prorl_rollout_run_limit", "Episodes the run stage may hold at once (fixed, or adaptive)", registry=r
        )
        self.run_target = Gauge(
            "prorl_rollout_run_target_engine_batch", "--target-engine-batch (0: a fixed limit)", registry=r
        )
        self.engine_requests = Gauge(
            "prorl_rollout_llm_engine_requests",
            "Requests an LLM server's engine reported, as last read from its /metrics: running, waiting, and of those "
            "waiting_for_capacity",
            ["server", "state"],
            registry=r,
        )

    def count_warm(self, hits: int, misses: int) -> None:
        """Bring the hit and miss counters up to the warm pool's totals (at each scrape)."""
        for outcome, total in (("hit", hits), ("miss", misses)):
            self.warm.labels(outcome).inc(total - self._warm_counted[outcome])
            self._warm_counted[outcome] = total

    def set_run_concurrency(self, state: RunConcurrencyState) -> None:
        self.run_limit.set(state.limit)
        self.run_target.set(state.target_engine_batch or 0)
        self.engine_requests.clear()  # servers gone, or without metrics now, are not reported
        for server in state.servers:
            for figure in ("running", "waiting", "waiting_for_capacity"):
                if (value := getattr(server, figure)) is not None:
                    self.engine_requests.labels(server.url, figure).set(value)

    @hookimpl
    def prorl_job_finished(self, trajectory: Trajectory, state: JobState) -> None:
        error_class = trajectory.error.error_class if trajectory.error else ""
        self.jobs.labels(trajectory.task, state.value, error_class).inc()
        if TAMPERED_ARTIFACT in trajectory.artifacts:
            self.tampered.labels(trajectory.task).inc()
        for stage in ("queued_s", "init_s", "run_s", "eval_s"):
            self.stage_seconds.labels(stage.removesuffix("_s")).observe(getattr(trajectory.timings, stage))
        if state is JobState.done:
            self.reward.labels(trajectory.task).observe(trajectory.reward)

    def render(self) -> bytes:
        return generate_latest(self.registry)
