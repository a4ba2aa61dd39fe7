"""Prometheus metrics of the rollout service, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..hooks.specs import hookimpl
from ..models import BatchItem, BreakerState, JobState, LLMOutage, RunConcurrencyState, Trajectory

TAMPERED_ARTIFACT = "tampered"  # the artifact a task's eval sets when it found the grading tampered with
_SECONDS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900, 1800)
_STALENESS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
TOKEN_BUCKETS = tuple(2**n for n in range(6, 16))  # 64 .. 32768


def response_tokens(trajectory: Trajectory) -> int:
    """Every token after the prompt, the policy's and the tools', in all the trajectory's sequences."""
    return len(trajectory.response_ids) + sum(len(segment.response_ids) for segment in trajectory.segments)


UNKNOWN_LENGTH = "unknown"  # the length bucket of a cut run that kept nothing


def length_bucket(tokens: int) -> str:
    """The label of the smallest TOKEN_BUCKETS bound that holds `tokens` ("<=1024"), or ">32768"."""
    bound = next((b for b in TOKEN_BUCKETS if tokens <= b), None)
    return f"<={bound}" if bound is not None else f">{TOKEN_BUCKETS[-1]}"


def truncation_budget(trajectory: Trajectory) -> str | None:
    """The budget that cut the trajectory short (its `cut`, as the pipeline recorded it), or None."""
    return trajectory.cut.budget if trajectory.cut is not None else None


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
        # What a trainer is handed (POST /v1/batches): its version then, less the trajectory's oldest turn's.
        self.staleness_at_training = Histogram(
            "prorl_rollout_staleness_at_training",
            "Versions between a trajectory's oldest turn and the policy version when a trainer takes it (decoupled "
            "mode, each delivery)",
            buckets=_STALENESS,
            registry=r,
        )
        self.trajectory_tokens = Histogram(
            "prorl_rollout_trajectory_tokens",
            "Response tokens (the policy's and the tools', every sequence) of graded trajectories",
            ["task"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.truncated = Counter(
            "prorl_rollout_truncated_trajectories",
            "Trajectories cut short by a budget (init_timeout, run_timeout, eval_timeout, max_turns, max_context, "
            "agent_timeout), by the length they had (the response tokens' bucket)",
            ["task", "budget", "length_bucket"],
            registry=r,
        )
        # The circuit breaker (circuit_breaker.py), set from its state at each scrape.
        self.breaker_tripped = Gauge(
            "prorl_rollout_breaker_tripped", "1 while the circuit breaker holds admission back", registry=r
        )
        self.breaker_trips = Counter("prorl_rollout_breaker_trips", "Times the circuit breaker tripped", registry=r)
        self.breaker_signals = Counter(
            "prorl_rollout_breaker_signal_episodes",
            "Finished episodes that showed a signal the circuit breaker reads (tampered, sandbox_limits, refused)",
            ["signal"],
            registry=r,
        )
        self._breaker_counted: dict[str, int] = {"trips": 0}
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
            "Decoupled mode: upcoming, in_flight, leased, undelivered now; produced, filtered, retried, outage_reruns, "
            "dropped, expired, redelivered, dead_letters, admission_lock_lapses since start",
            ["figure"],
            registry=r,
        )
        self.degraded = Gauge(
            "prorl_rollout_degraded", "1 while the buffer or the prompt queue cannot be used (see /healthz)", registry=r
        )
        # LLM outages (llm.LLMPool.outage), set from the pool at each scrape.
        self.llm_outage = Gauge(
            "prorl_rollout_llm_outage",
            "1 while no episode can generate: no LLM server healthy, or an error-rate spike (see /healthz)",
            registry=r,
        )
        self.llm_outage_waits = Counter(
            "prorl_rollout_llm_outage_waits",
            "Turns that waited for a healthy LLM server during an outage",
            registry=r,
        )
        self._outage_waits_counted = 0
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

    def set_breaker(self, state: BreakerState, totals: dict[str, int]) -> None:
        """The breaker's gauge, and its counters brought up to its totals (at each scrape)."""
        self.breaker_tripped.set(state.tripped)
        counters = {"trips": (self.breaker_trips, state.trips)}
        counters.update({signal: (self.breaker_signals.labels(signal), n) for signal, n in totals.items()})
        for name, (counter, total) in counters.items():
            counter.inc(total - self._breaker_counted.get(name, 0))
            self._breaker_counted[name] = total

    def set_llm_outage(self, outage: LLMOutage | None, waits: int) -> None:
        """The outage gauge, and the waits counter brought up to the pool's total (at each scrape)."""
        self.llm_outage.set(outage is not None)
        self.llm_outage_waits.inc(waits - self._outage_waits_counted)
        self._outage_waits_counted = waits

    def took(self, items: list[BatchItem], version: int) -> None:
        """A trainer took `items` at policy `version`: their staleness then."""
        for item in items:
            self.staleness_at_training.observe(version - item.trajectory.policy_version_min)

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
            self.trajectory_tokens.labels(trajectory.task).observe(response_tokens(trajectory))
        if state is not JobState.cancelled and (budget := truncation_budget(trajectory)) is not None:
            # A run cut by its time budget with nothing kept (an agent program's: its calls are not gathered
            # before it ends) is of a length nobody knows, not a short one.
            unknown = budget == "run_timeout" and not trajectory.num_turns
            bucket = UNKNOWN_LENGTH if unknown else length_bucket(response_tokens(trajectory))
            self.truncated.labels(trajectory.task, budget, bucket).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
