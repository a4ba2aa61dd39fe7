"""The storage parts' contract suites: one suite per contract, run over the memory and the Redis implementation
(conftest.py's `kind`). See conftest.py for how Redis is found."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from prorl_adapter.models import BatchItem, StageTimings, Trajectory

KINDS = ("memory", "redis")


async def assert_blocked(task: asyncio.Task, within: float = 0.1) -> None:
    """The task must not complete (it waits on the storage)."""
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), within)
    assert not task.done()


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll `condition` (what a test cannot await: a job taken by a replica's own loop) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


def make_trajectory(job_id: str, version: int = 0) -> Trajectory:
    """A buffer entry of policy version `version` (its oldest and newest turn's)."""
    return Trajectory(
        job_id=job_id,
        task="test",
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5, 6],
        response_mask=[1, 0, 1],
        response_logprobs=[-0.5, 0.0, -1.25],
        turns=[],
        num_turns=1,
        finish_reason="finish",
        reward=1.0,
        policy_version_min=version,
        policy_version_max=version,
        timings=StageTimings(),
    )


def jobs(batch: list[BatchItem]) -> list[str]:
    return [b.trajectory.job_id for b in batch]
