"""Decoupled mode end to end: the service produces into the buffer ahead of a trainer that consumes batches
and publishes policy versions, with the staleness plugin pacing or dropping (real vLLM, bwrap, HTTP)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.trainer.client import RolloutAPIError, RolloutClient

from .conftest import start_rollout
from .test_rollout import shell_job


def rollout_with(vllm, sandbox_server, tmp_path, staleness: dict):
    config = tmp_path / "plugins.json"
    config.write_text(json.dumps({"staleness": staleness}))
    return start_rollout([sandbox_server.url], [vllm.url], "--plugin-config", str(config))


async def train(client: RolloutClient, steps: int, batch_size: int) -> list[tuple[int, int, float]]:
    """A trainer: take a batch, 'train', publish the next version, acknowledge. Returns (version at consume,
    trajectory version, weight) of every consumed trajectory."""
    consumed = []
    for step in range(steps):
        batch = await client.take_batch(batch_size, timeout=300)
        assert batch.items, "the producer must keep the trainer fed"
        consumed += [(batch.policy_version, i.trajectory.policy_version_min, i.weight.sample) for i in batch.items]
        await client.set_policy_version(step + 1)
        await client.ack([item.id for item in batch.items])
    return consumed


async def test_pace_keeps_every_trajectory_within_k(vllm, sandbox_server, tmp_path):
    rollout = rollout_with(vllm, sandbox_server, tmp_path, {"mode": "pace", "max_staleness": 1, "batch_size": 2})
    try:
        async with RolloutClient(rollout.url) as client:
            assert await client.enqueue_prompts([shell_job("pwd", max_turns=1) for _ in range(8)]) >= 1
            consumed = await train(client, steps=4, batch_size=2)
            status = await client.buffer()
    finally:
        rollout.stop()
    assert len(consumed) == 8  # nothing dropped
    assert all(current - version <= 1 and weight == 1.0 for current, version, weight in consumed)
    assert status.produced == 8 and status.dropped == 0 and status.acked == 8


async def test_drop_mode_drops_what_is_too_stale(vllm, sandbox_server, tmp_path):
    rollout = rollout_with(vllm, sandbox_server, tmp_path, {"mode": "drop", "max_staleness": 0})
    try:
        async with RolloutClient(rollout.url) as client:
            await client.enqueue_prompts([shell_job("pwd", max_turns=1) for _ in range(4)])
            # All four produced at version 0 first: an episode that started after the version changed would be
            # fresh, and rightly taken.
            deadline = time.monotonic() + 300
            while (await client.buffer()).produced < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)  # until all four are in the buffer
            first = await client.take_batch(1, timeout=300)
            await client.set_policy_version(5)  # the trainer moved on: the other three are now 5 versions old
            await client.ack([item.id for item in first.items])
            # Too stale to weigh above 0: removed before the take.
            rest = await client.take_batch(3, timeout=0)
            status = await client.buffer()
    finally:
        rollout.stop()
    assert len(first.items) == 1 and rest.items == []
    assert status.expired == 3 and status.dropped == 0 and status.ready == 0


async def test_bad_plugin_config_fails_at_start_up(vllm, sandbox_server, tmp_path):
    with pytest.raises(RuntimeError, match="exited"):
        rollout_with(vllm, sandbox_server, tmp_path, {"mode": "sometimes", "max_staleness": 1})


async def test_decoupled_api_rejects_bad_input(vllm, sandbox_server, tmp_path):
    rollout = rollout_with(vllm, sandbox_server, tmp_path, {"mode": "off"})
    try:
        async with RolloutClient(rollout.url) as client:
            with pytest.raises(RolloutAPIError) as unknown:
                await client.enqueue_prompts([JobRequest(task="chess")])
            assert unknown.value.status == 400 and "chess" in unknown.value.message
            with pytest.raises(RolloutAPIError) as bad_size:
                await client._call("POST", "/v1/batches", json={"size": 0})
            assert bad_size.value.status == 400 and "size" in bad_size.value.message
            assert (await client.take_batch(1, timeout=0)).items == []
            assert await client.ack(["m12345"]) == 0  # of the buffer's form, never handed out: nothing to do
            with pytest.raises(RolloutAPIError) as malformed:  # of no form it hands out: the client's mistake
                await client.ack(["no-such-entry"])
            assert malformed.value.status == 400 and "not an entry id of this buffer" in malformed.value.message
    finally:
        rollout.stop()
