"""A fourth training backend is three hook implementations and nothing else: a toy trainer whose batch type is
`ToyBatch` runs coupled and decoupled episodes end to end through the driver (real vLLM, bwrap, the rollout
service over HTTP), with the shared staleness plugin unchanged and loaded from its entry point."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from prorl_adapter.hooks import PluginSet, hookimpl
from prorl_adapter.models import BatchItem, JobRequest
from prorl_adapter.trainer import RolloutClient, RolloutDriver
from prorl_adapter.trainer.samples import job_request

from .conftest import start_rollout
from .test_rollout import shell_job

STALENESS = {"mode": "linear", "max_staleness": 4}


# -- the whole backend -------------------------------------------------------------------------------------
@dataclass
class ToyBatch:
    """The toy trainer's request (`commands`, one episode each, at `step`) and its answer (`rows`)."""

    commands: list[str]
    step: int | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)


class ToyBackend:
    @hookimpl
    def prorl_backend_policy_version(self, batch: ToyBatch) -> int | None:
        return batch.step

    @hookimpl
    def prorl_backend_requests(self, batch: ToyBatch, config: dict[str, Any]) -> list[JobRequest]:
        template = shell_job(*batch.commands, max_turns=config["max_turns"])
        return [
            job_request(
                "shell", template.instance, group=f"g{i}", sampling=template.sampling, max_turns=template.max_turns
            )
            for i, _ in enumerate(batch.commands)
        ]

    @hookimpl
    def prorl_backend_batch(self, items: list[BatchItem], batch: ToyBatch | None) -> ToyBatch:
        answer = batch or ToyBatch(commands=[])
        answer.rows = [
            {"tokens": len(i.trajectory.response_ids), "loss": i.loss_weights(), "versions": i.token_versions()}
            for i in items
        ]
        return answer


# -- the tests -----------------------------------------------------------------------------------------------
def plugins() -> PluginSet:
    return PluginSet.load({"staleness": STALENESS}, objects=[ToyBackend()])


async def test_a_coupled_toy_batch_comes_back_in_the_toy_type(vllm, sandbox_server):
    rollout = start_rollout([sandbox_server.url], [vllm.url])
    try:
        async with RolloutClient(rollout.url) as client:
            # Two turns: the first turn's tool results are in the context (the last turn's are not appended).
            driver = RolloutDriver(client, plugins(), {"max_turns": 2}, wait_s=300)
            answer = await driver.generate(ToyBatch(commands=["pwd", "ls"], step=3))
            assert (await client.status()).policy_version == 3  # the backend's version, published first
    finally:
        rollout.stop()
    assert isinstance(answer, ToyBatch) and len(answer.rows) == 2
    for row in answer.rows:
        assert row["tokens"] > 0 and len(row["loss"]) == row["tokens"] == len(row["versions"])
        assert set(row["loss"]) == {1.0}  # fresh: linear weight 1
        assert 3 in row["versions"] and None in row["versions"]  # the policy's turn at 3, the tool's tokens


async def test_a_decoupled_toy_batch_is_weighed_by_the_services_plugin(vllm, sandbox_server, tmp_path):
    config = tmp_path / "plugins.json"
    config.write_text(json.dumps({"staleness": STALENESS}))
    rollout = start_rollout([sandbox_server.url], [vllm.url], "--plugin-config", str(config))
    try:
        async with RolloutClient(rollout.url) as client:
            driver = RolloutDriver(client, plugins(), {"max_turns": 1})
            await driver.set_policy_version(0)
            await driver.enqueue(ToyBatch(commands=["pwd", "ls"]))
            first = await driver.take(1, timeout=300)
            await driver.set_policy_version(2)  # the trainer moved on: the second one is 2 of K=4 versions old
            await driver.ack(first)
            second = await driver.take(1, timeout=300)
            answer = driver.to_batch(second)
            await driver.ack(second)
    finally:
        rollout.stop()
    assert second[0].weight.sample == 0.5  # linear: 1 - 2/4, weighed once, by the service, when taken
    assert set(answer.rows[0]["loss"]) == {0.5}
