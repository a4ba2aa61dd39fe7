"""The untrained policy's success rate on a workload, measured through the rollout service.

GRPO learns only from groups whose episodes differ: a task the untrained model never solves (or always does)
gives every group the same reward and no gradient. Issue 39 asks for a task where the real model starts
between 5% and 50%; `measure_base` runs `episodes` episodes (`group_size` per question, as training asks for
them) with the weights as built and counts.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, replace
from typing import Any

from prorl_adapter.models import Trajectory
from prorl_adapter.trainer import RolloutClient

from .train import TrainSettings, episode_requests
from .workloads import workload


@dataclass
class BaseRate:
    episodes: int
    successes: int
    mixed_groups: int  # groups whose episodes got different outcomes: the ones GRPO learns from
    groups: int
    finish_reasons: dict[str, int]
    turns_mean: float
    parse_errors: int  # turns whose text held an action that could not be read
    python_turns: int  # turns that ran a python block
    response_tokens_mean: float  # policy tokens per episode
    failed: int  # episodes that ended in an error (init, run, eval, timeout)
    seconds: float

    @property
    def rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "rate": self.rate}


def outcome(trajectory: Trajectory) -> float:
    return trajectory.reward_components.get("outcome", 0.0)


def summarize(trajectories: list[Trajectory], seconds: float) -> BaseRate:
    groups: dict[str, set[float]] = defaultdict(set)
    for t in trajectories:
        groups[t.group or t.job_id].add(outcome(t))
    turns = [turn for t in trajectories for turn in t.turns]
    return BaseRate(
        episodes=len(trajectories),
        successes=sum(outcome(t) >= 1.0 for t in trajectories),
        mixed_groups=sum(len(outcomes) > 1 for outcomes in groups.values()),
        groups=len(groups),
        finish_reasons=dict(Counter(str(t.finish_reason) for t in trajectories)),
        turns_mean=statistics.fmean(t.num_turns for t in trajectories) if trajectories else 0.0,
        parse_errors=sum(bool(turn.tool_call_errors) for turn in turns),
        python_turns=sum(any(c.name == "python" for c in turn.tool_calls) for turn in turns),
        response_tokens_mean=statistics.fmean(sum(t.response_mask) for t in trajectories) if trajectories else 0.0,
        failed=sum(t.error is not None for t in trajectories),
        seconds=seconds,
    )


async def measure_base(rollout_url: str, settings: TrainSettings, episodes: int) -> tuple[BaseRate, list[Trajectory]]:
    """`episodes` episodes of the workload (rounded up to whole groups of `group_size`), on questions that no
    training run of the same seed uses first (seed + 10,000), with whatever weights the server has."""
    count = -(-episodes // settings.group_size)
    held_out = replace(settings, seed=settings.seed + 10_000)
    rows = workload(settings.workload).rows(count, held_out)
    started = time.perf_counter()
    async with RolloutClient(rollout_url, timeout=600) as client:
        trajectories = await client.run_many(episode_requests(settings, rows))
    return summarize(trajectories, time.perf_counter() - started), trajectories
