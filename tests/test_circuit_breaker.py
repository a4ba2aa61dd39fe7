"""The circuit breaker (circuit_breaker.py) and the metrics of issue 43 item 5: the breaker counts one policy
version's episodes and their signals, trips at its threshold once it has counted its minimum, refuses POST
/v1/jobs (503) and holds the decoupled producer back while tripped, shows in /v1/status and /metrics, and only an
operator's reset closes it. The metrics: staleness at training, trajectory length, truncations by budget and
length bucket. The service is `create_app` on the stand-ins (tests/fakes); time is virtual."""

from __future__ import annotations

import re
from typing import Any

import pytest

from prorl_adapter.models import (
    AgentProgram,
    BatchItem,
    BudgetCut,
    JobError,
    JobRequest,
    JobState,
    StageTimings,
    Trajectory,
)
from prorl_adapter.service.agent_program import run_program
from prorl_adapter.service.circuit_breaker import BreakerConfig, CircuitBreaker, share_lower_bound
from prorl_adapter.service.gateway import REFUSED_ARTIFACT
from prorl_adapter.service.metrics import TAMPERED_ARTIFACT, RolloutMetrics, length_bucket, truncation_budget
from prorl_adapter.service.server import BREAKER, METRICS, PIPELINE
from prorl_adapter.tasks import SANDBOX_LIMITS_ARTIFACT
from sandbox_runtime.models import ExecResult
from tests.fakes import HANG, Stack, bash_call, finish_call, on_virtual_time, rollout_stack, shell_job

USER = [{"role": "user", "content": "list the files"}]
KILLED = "python3 hog.py"  # the stand-in answers it with exit code 137: what a memory limit's kill leaves


def trajectory(
    version: int = 0,
    artifacts: dict[str, str] | None = None,
    turns: int = 1,
    tokens: int = 0,
    **fields: Any,
) -> Trajectory:
    values: dict[str, Any] = {
        "job_id": "j",
        "task": "shell",
        "prompt_ids": [1, 2],
        "response_ids": [7] * tokens,
        "response_mask": [1] * tokens,
        "response_logprobs": [0.0] * tokens,
        "turns": [],
        "num_turns": turns,
        "finish_reason": "finish",
        "policy_version_min": version,
        "policy_version_max": version,
        "timings": StageTimings(),
        "artifacts": artifacts or {},
    }
    return Trajectory(**{**values, **fields})


TAMPERED = {TAMPERED_ARTIFACT: "the canary tests passed: the runner was rewritten"}


def finish(breaker: CircuitBreaker, count: int, state: JobState = JobState.done, **fields: Any) -> None:
    for _ in range(count):
        breaker.prorl_job_finished(trajectory=trajectory(**fields), state=state)


# -- the breaker alone ------------------------------------------------------------------------------------
def test_it_trips_at_the_threshold_once_it_has_counted_min_episodes():
    breaker = CircuitBreaker(BreakerConfig(threshold=0.2, min_episodes=10))
    finish(breaker, 9, artifacts=TAMPERED)  # 9 of 9 flagged, but fewer than min_episodes counted
    assert not breaker.tripped and breaker.prorl_admit_episode(state=None) is None
    finish(breaker, 1)  # 9 of 10: at least 42% with 99.9% confidence, above 0.2
    assert breaker.tripped and breaker.prorl_admit_episode(state=None) is False
    state = breaker.describe()
    assert (state.enabled, state.tripped, state.version, state.trips) == (True, True, 0, 1)
    assert (state.tally.episodes, state.tally.flagged, state.tally.signals["tampered"]) == (10, 9, 9)
    assert "9 of 10 episodes" in state.reason and "tampered 9" in state.reason


def test_a_share_above_the_threshold_by_chance_does_not_trip_it():
    """3 of 10 is above 0.2, but a policy whose true share is 0.1 shows it one version in fifteen: the breaker
    trips on the share's lower confidence bound, so that weighing every version after every episode does not
    trip it by chance over a run (share_lower_bound)."""
    breaker = CircuitBreaker(BreakerConfig(threshold=0.2, min_episodes=10))
    finish(breaker, 7)
    finish(breaker, 3, artifacts=TAMPERED)
    assert not breaker.tripped
    assert share_lower_bound(3, 10) < 0.2 < share_lower_bound(9, 10) and share_lower_bound(0, 5) == 0.0


def test_a_share_below_the_threshold_does_not_trip_it():
    breaker = CircuitBreaker(BreakerConfig(threshold=0.5, min_episodes=2))
    finish(breaker, 2)
    finish(breaker, 1, artifacts={SANDBOX_LIMITS_ARTIFACT: "2"})
    assert not breaker.tripped  # 1 of 3 (weighed at each episode: 0 of 2, then 1 of 3)
    assert breaker.describe().versions[0].signals["sandbox_limits"] == 1


def test_it_counts_each_version_apart_by_the_newest_version_that_acted():
    breaker = CircuitBreaker(BreakerConfig(threshold=0.25, min_episodes=4))  # 4 of 4 trips it, 3 of 4 does not
    finish(breaker, 2, version=1, artifacts=TAMPERED)
    finish(breaker, 2, version=2)
    # Spanning versions 1 and 2, it counts for 2: 3 flagged of version 1 alone would have tripped it.
    finish(breaker, 1, version=1, policy_version_max=2, artifacts=TAMPERED)
    assert not breaker.tripped
    assert [(t.version, t.episodes, t.flagged) for t in breaker.describe().versions] == [(2, 3, 1), (1, 2, 2)]
    finish(breaker, 2, version=1, artifacts=TAMPERED)
    assert breaker.tripped and breaker.describe().version == 1


def test_episodes_the_policy_never_acted_in_and_cancelled_ones_do_not_count():
    breaker = CircuitBreaker(BreakerConfig(threshold=0.5, min_episodes=1))
    finish(breaker, 3, turns=0, artifacts=TAMPERED, error=JobError(error_class="init", message="no sandbox"))
    finish(breaker, 3, state=JobState.cancelled, artifacts=TAMPERED)
    assert not breaker.tripped and breaker.describe().versions == []


def test_only_the_signals_it_is_told_to_weigh_flag_an_episode():
    breaker = CircuitBreaker(BreakerConfig(threshold=0.5, min_episodes=2, signals=("tampered",)))
    finish(breaker, 2, artifacts={SANDBOX_LIMITS_ARTIFACT: "1"})
    assert not breaker.tripped
    [tally] = breaker.describe().versions
    assert (tally.flagged, tally.signals["sandbox_limits"]) == (0, 2)


def test_off_by_default_it_counts_but_never_trips():
    breaker = CircuitBreaker()
    finish(breaker, 50, artifacts=TAMPERED)
    state = breaker.describe()
    assert (state.enabled, state.tripped, breaker.totals["tampered"]) == (False, False, 50)


def test_a_new_version_leaves_it_tripped_and_a_reset_forgets_every_count():
    breaker = CircuitBreaker(BreakerConfig(threshold=0.05, min_episodes=1))  # 1 of 1 trips it
    finish(breaker, 1, artifacts=TAMPERED)
    finish(breaker, 5, version=1)
    assert breaker.tripped and breaker.describe().version == 0
    state = breaker.reset()
    assert (state.tripped, state.versions, state.trips) == (False, [], 1)
    finish(breaker, 1, artifacts=TAMPERED)
    assert breaker.tripped and breaker.trips == 2


@pytest.mark.parametrize(
    "options", [{"threshold": 0.0}, {"threshold": 1.5}, {"min_episodes": 0}, {"signals": ("tampered", "typo")}]
)
def test_settings_that_cannot_work_are_refused_naming_the_option(options):
    with pytest.raises(ValueError, match="--breaker-"):
        BreakerConfig(**{"threshold": 0.2, **options}).check()


# -- the metrics ------------------------------------------------------------------------------------------
def test_staleness_at_training_is_the_version_then_less_the_oldest_turns():
    metrics = RolloutMetrics()
    items = [BatchItem(id=str(v), trajectory=trajectory(version=v)) for v in (5, 3, 0)]
    metrics.took(items, version=5)
    sample = metrics.registry.get_sample_value
    assert sample("prorl_rollout_staleness_at_training_count") == 3
    assert sample("prorl_rollout_staleness_at_training_sum") == 0 + 2 + 5
    assert [
        sample("prorl_rollout_staleness_at_training_bucket", {"le": le}) for le in ("0.0", "2.0", "4.0", "6.0")
    ] == [
        1,
        2,
        2,
        3,
    ]


def test_graded_trajectories_are_measured_in_response_tokens_by_task():
    metrics = RolloutMetrics()
    metrics.prorl_job_finished(trajectory=trajectory(tokens=100), state=JobState.done)
    metrics.prorl_job_finished(trajectory=trajectory(tokens=5000), state=JobState.done)
    failed = trajectory(tokens=10, error=JobError(error_class="run", message="LLM"), finish_reason="error")
    metrics.prorl_job_finished(trajectory=failed, state=JobState.failed)  # not graded: not measured
    sample = metrics.registry.get_sample_value
    assert sample("prorl_rollout_trajectory_tokens_count", {"task": "shell"}) == 2
    assert sample("prorl_rollout_trajectory_tokens_bucket", {"task": "shell", "le": "128.0"}) == 1
    assert sample("prorl_rollout_trajectory_tokens_bucket", {"task": "shell", "le": "4096.0"}) == 1
    assert sample("prorl_rollout_trajectory_tokens_bucket", {"task": "shell", "le": "8192.0"}) == 2


def test_a_trajectory_cut_by_a_budget_is_counted_by_budget_and_length_bucket():
    metrics = RolloutMetrics()
    timeout = JobError(error_class="timeout", message="time budget of 120 s spent in running")

    def by(budget: str, limit: float = 120, used: float = 120) -> BudgetCut:
        return BudgetCut(budget=budget, setting="timeout_s", limit=limit, used=used)

    cut = [
        trajectory(tokens=700, error=timeout, finish_reason="error", cut=by("run_timeout")),
        trajectory(tokens=0, error=timeout, finish_reason="error", cut=by("init_timeout")),
        trajectory(tokens=900, error=timeout, finish_reason="error", cut=by("eval_timeout")),
        trajectory(tokens=40_000, finish_reason="max_context", cut=by("max_context", 40_002, 40_002)),
        trajectory(tokens=64, finish_reason="max_turns", cut=by("max_turns", 1, 1)),
    ]
    assert [truncation_budget(t) for t in cut] == [
        "run_timeout",
        "init_timeout",
        "eval_timeout",
        "max_context",
        "max_turns",
    ]
    for t in cut:
        metrics.prorl_job_finished(trajectory=t, state=JobState.failed if t.error else JobState.done)
    metrics.prorl_job_finished(trajectory=trajectory(tokens=64), state=JobState.done)  # finished: not cut
    sample = metrics.registry.get_sample_value
    name = "prorl_rollout_truncated_trajectories_total"
    assert sample(name, {"task": "shell", "budget": "run_timeout", "length_bucket": "<=1024"}) == 1
    assert sample(name, {"task": "shell", "budget": "init_timeout", "length_bucket": "<=64"}) == 1
    program_cut = trajectory(turns=0, error=timeout, finish_reason="error", cut=by("run_timeout"))
    metrics.prorl_job_finished(trajectory=program_cut, state=JobState.failed)  # kept nothing: length unknown
    assert sample(name, {"task": "shell", "budget": "run_timeout", "length_bucket": "unknown"}) == 1
    assert sample(name, {"task": "shell", "budget": "max_context", "length_bucket": ">32768"}) == 1
    assert sample(name, {"task": "shell", "budget": "max_turns", "length_bucket": "<=64"}) == 1
    assert (length_bucket(65), length_bucket(32768)) == ("<=128", "<=32768")


# -- the service ------------------------------------------------------------------------------------------
async def a_killed_episode(stack: Stack) -> Trajectory:
    """An episode whose one command a sandbox limit killed (exit code 137)."""
    return await stack.client.run(shell_job(), wait=60)


@on_virtual_time
async def test_a_tripped_breaker_refuses_jobs_shows_why_and_a_reset_reopens_it():
    options = {"threshold": 0.15, "min_episodes": 2}  # 2 of 2 trips it
    async with rollout_stack(script=[bash_call(KILLED), finish_call()], breaker=options) as stack:
        stack.sandbox.exit_codes[KILLED] = 137
        first = await a_killed_episode(stack)
        assert first.artifacts[SANDBOX_LIMITS_ARTIFACT] == "1" and first.reward == 1.0  # graded as ever
        assert (await stack.http.get("/v1/status")).status == 200
        await a_killed_episode(stack)

        refused = await stack.http.post("/v1/jobs", json=shell_job().model_dump(mode="json"))
        body = await refused.json()
        assert refused.status == 503 and "sandbox_limits 2" in body["error"]
        status = (await (await stack.http.get("/v1/status")).json())["breaker"]
        assert (status["tripped"], status["version"], status["tally"]["flagged"]) == (True, 0, 2)
        assert "2 of 2 episodes" in status["reason"]
        metrics = await (await stack.http.get("/metrics")).text()
        assert "prorl_rollout_breaker_tripped 1.0" in metrics
        assert 'prorl_rollout_breaker_signal_episodes_total{signal="sandbox_limits"} 2.0' in metrics
        assert "prorl_rollout_breaker_trips_total 1.0" in metrics

        await stack.client.set_policy_version(1)  # a new version does not close it
        assert (await stack.http.post("/v1/jobs", json=shell_job().model_dump(mode="json"))).status == 503

        reset = await stack.http.post("/v1/breaker/reset")
        assert reset.status == 200 and (await reset.json())["tripped"] is False
        assert (await stack.http.post("/v1/jobs", json=shell_job().model_dump(mode="json"))).status == 202
        metrics = await (await stack.http.get("/metrics")).text()
        assert "prorl_rollout_breaker_tripped 0.0" in metrics


@on_virtual_time
async def test_the_reset_needs_the_token_and_is_off_by_default():
    async with rollout_stack(token="secret") as stack:
        assert (await stack.http.post("/v1/breaker/reset")).status == 401
        status = await stack.client.status()
        assert status.breaker.enabled is False and status.breaker.tripped is False


@on_virtual_time
async def test_while_tripped_the_producer_starts_no_queued_prompt_and_running_episodes_finish():
    options = {"threshold": 0.05, "min_episodes": 1}  # 1 of 1 trips it
    async with rollout_stack(script=[bash_call(KILLED), finish_call()], breaker=options) as stack:
        stack.sandbox.exit_codes[KILLED] = 137
        stack.llm.cue(HANG)
        running = await stack.client.submit(shell_job())  # running when the breaker trips: it finishes
        await stack.llm.until(lambda: stack.llm.held == 1)
        await a_killed_episode(stack)
        assert stack.app[BREAKER].tripped

        await stack.client.enqueue_prompts([shell_job(job_id=f"prompt-{i}") for i in range(2)])
        assert (await stack.client.take_batch(1, timeout=600)).items == []  # 600 virtual seconds: nothing ran
        assert not {box.labels["job_id"] for box in stack.sandbox.created} & {"prompt-0", "prompt-1"}
        buffer = await stack.client.buffer()
        assert (buffer.upcoming, buffer.held_back) == (2, True)
        stack.llm.release()
        assert (await stack.client.result(running.job_id, wait=60)).reward == 1.0

        await stack.http.post("/v1/breaker/reset")
        stack.sandbox.exit_codes.pop(KILLED)
        batch = await stack.client.take_batch(2, timeout=600)
        assert {item.trajectory.job_id for item in batch.items} == {"prompt-0", "prompt-1"}


@on_virtual_time
async def test_a_batch_taken_is_observed_at_the_version_of_the_take():
    async with rollout_stack(script=[finish_call()]) as stack:
        await stack.client.enqueue_prompts([shell_job(job_id="p")])
        await stack.client.take_batch(1, timeout=600, lease_s=600)  # made at version 0, taken at 0
        registry = stack.app[METRICS].registry
        assert registry.get_sample_value("prorl_rollout_staleness_at_training_bucket", {"le": "0.0"}) == 1


@on_virtual_time
async def test_a_run_cut_by_its_time_budget_keeps_what_it_made_and_is_counted_by_length():
    async with rollout_stack(script=[bash_call("echo hi"), HANG]) as stack:
        trajectory_ = await stack.client.run(shell_job(timeout_s=120), wait=3600)
        assert trajectory_.error.error_class == "timeout" and trajectory_.filter
        assert trajectory_.num_turns == 1 and len(trajectory_.response_ids) > 0  # the first turn, kept
        metrics = await (await stack.http.get("/metrics")).text()
        stack.llm.release()
    bucket = length_bucket(len(trajectory_.response_ids))
    assert (
        f'prorl_rollout_truncated_trajectories_total{{budget="run_timeout",length_bucket="{bucket}",task="shell"}} 1.0'
        in metrics
    )


@on_virtual_time
async def test_the_gateway_counts_what_it_refuses_an_episodes_sandbox_but_not_a_full_context():
    async with rollout_stack(script=["done"]) as stack:
        gateway = stack.app[PIPELINE].gateway
        episode = gateway.open("job-1", JobRequest(task="shell", max_turns=1, max_context_tokens=64))
        url = f"/gateway/{episode.key}/v1/chat/completions"
        long = [{"role": "user", "content": "x" * 200}]
        assert (await stack.gateway.post(url, json={"model": "m", "messages": long})).status == 400  # a full context
        assert episode.refused == 0
        assert (await stack.gateway.post(url, json={"model": "m", "messages": USER})).status == 400  # turns spent
        assert episode.refused == 0  # the first call past the limit: every harness that runs to it makes one
        assert (await stack.gateway.post(url, json={"model": "m", "messages": USER})).status == 400
        assert episode.refused == 1

        other = gateway.open("job-2", JobRequest(task="shell"))
        hosted = {"model": "m", "messages": USER, "tools": [{"type": "web_search"}]}
        assert (await stack.gateway.post(f"/gateway/{other.key}/v1/chat/completions", json=hosted)).status == 400
        assert other.refused == 1  # a tool it does not serve


class ProgramSandbox:
    """A stand-in sandbox whose `exec` plays an agent program: with the key it was given, one request the gateway
    refuses (past the turn limit it is not yet: a hosted tool), then one call it answers."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    async def exec(self, command: str, timeout: float = 30.0, max_output_bytes: int | None = None) -> ExecResult:
        key = re.search(r"OPENAI_API_KEY=(\S+?);", command).group(1)
        url = f"/gateway/{key}/v1/chat/completions"
        hosted = {"model": "m", "messages": USER, "tools": [{"type": "web_search"}]}
        assert (await self.stack.gateway.post(url, json=hosted)).status == 400
        assert (await self.stack.gateway.post(url, json={"model": "m", "messages": USER})).status == 200
        return ExecResult(output="", exit_code=0, status="completed", truncated=False, duration_s=0.0, cwd="/")


@on_virtual_time
async def test_an_agent_programs_refused_requests_reach_its_trajectory():
    async with rollout_stack(script=["done"]) as stack:
        request = shell_job(agent=AgentProgram(command="my-harness"))
        handler = stack.app[PIPELINE].tasks["shell"]
        gateway = stack.app[PIPELINE].gateway
        episode = await run_program("job-1", request, handler, ProgramSandbox(stack), gateway, budget_s=600)
    assert episode.state.artifacts[REFUSED_ARTIFACT] == "1" and len(episode.turns) == 1


@pytest.mark.parametrize(
    ("status", "exit_code", "counted"),
    [("completed", 137, True), ("completed", 152, True), ("completed", 1, False), ("timeout", None, False)],
)
def test_a_limits_signal_counts_as_sandbox_limits_and_a_tool_calls_own_timeout_does_not(status, exit_code, counted):
    from prorl_adapter.tasks import EpisodeState, note_limits

    state = EpisodeState()
    result = ExecResult(output="", exit_code=exit_code, status=status, truncated=False, duration_s=1.0, cwd="/")
    note_limits(result, state)
    assert (SANDBOX_LIMITS_ARTIFACT in state.artifacts) is counted
