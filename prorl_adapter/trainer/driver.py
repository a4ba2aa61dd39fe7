"""`RolloutDriver`: the one path between a trainer and the rollout service, whatever the training backend.

    trainer request ─ prorl_backend_policy_version ─> PUT /v1/policy-version
    weight push ───── weight_update(version, mode) ─> POST /v1/weight-update/pause ... /resume
                    ─ prorl_backend_requests ───────> jobs on the service (coupled: run now; decoupled: upcoming)
    trajectories ──── weights (PluginSet.weigh) ────> prorl_backend_batch ─> the trainer's batch type

A backend (verl's agent loop, SkyRL's generator, the CPU trainer, a user's own) implements the three backend
hooks and hands its requests to the driver; the driver calls the hooks, talks to the service and weighs what
comes back, so staleness control and reward shaping stay the shared plugins' business. Weighing happens once
per consumed trajectory: here for a coupled batch, and in the service for a batch taken from its buffer (it
weighs when it hands the batch out, and drops what weighs 0 there).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from server_kit.errors import ProrlError

from ..hooks.plugin_set import PluginSet
from ..models import BatchItem, JobRequest, WeightUpdateMode, WeightUpdateState
from .client import RolloutClient
from .groups import GroupCollector


class NoBackend(ProrlError, TypeError):
    """No registered backend plugin answered a backend hook for this batch type."""


class RolloutDriver:
    def __init__(
        self,
        client: RolloutClient,
        plugins: PluginSet,
        backend_config: Mapping[str, Any] | None = None,
        wait_s: float = 3600.0,
        shared_version: bool = False,
    ) -> None:
        """`backend_config`: what `prorl_backend_requests` gets as `config` (e.g. max_turns for every job);
        `wait_s`: how long a coupled batch may take; `shared_version`: several trainer workers publish the same
        versions in no fixed order (verl), so a published version never lowers the service's."""
        self.client = client
        self.plugins = plugins
        self.backend_config = dict(backend_config or {})
        self.wait_s = wait_s
        self.shared_version = shared_version
        self.published: int | None = None  # the last version this driver published
        self._groups: dict[int, GroupCollector] = {}

    # -- requests -----------------------------------------------------------------------------------------
    def requests(self, batch: Any) -> list[JobRequest]:
        requests = self.plugins.hooks.prorl_backend_requests(batch=batch, config=self.backend_config)
        if requests is None:
            raise NoBackend(f"no backend plugin turns a {type(batch).__name__} into rollout jobs")
        return requests

    async def set_policy_version(self, version: int) -> None:
        """Publish the trainer's policy version to the service (every turn sampled from now is tagged with it)."""
        if version == self.published:
            return
        await self.client.set_policy_version(version, raise_only=self.shared_version)
        self.published = version
        self.plugins.notify("prorl_policy_version_changed", version=version)

    @contextlib.asynccontextmanager
    async def weight_update(
        self, version: int, mode: WeightUpdateMode = "drain", timeout_s: float = 600.0
    ) -> AsyncIterator[WeightUpdateState]:
        """Hold the service's weight-update barrier while the trainer pushes the weights of `version`:

            async with driver.weight_update(step + 1, mode="abort"):
                push_weights()

        Nothing generates inside the block; on leaving it the service tags new tokens with `version` and generation
        goes on (with `abort`, the interrupted turns too). If the block raises, the barrier is released with the
        version unchanged."""
        async with self.client.weight_update(version, mode, timeout_s, raise_only=self.shared_version) as state:
            yield state
        self.published = version
        self.plugins.notify("prorl_policy_version_changed", version=version)

    async def publish_version(self, batch: Any) -> int | None:
        """The backend's version for `batch` (`prorl_backend_policy_version`), published; None if it has none."""
        version = self.plugins.hooks.prorl_backend_policy_version(batch=batch)
        if version is not None:
            await self.set_policy_version(version)
        return version

    # -- coupled: a request in, its batch out --------------------------------------------------------------
    async def generate(self, batch: Any) -> Any:
        """Run `batch`'s episodes now and return the backend's batch type, each trajectory weighed at the
        trainer's version (the backend's, else the newest version the episodes ran at)."""
        version = await self.publish_version(batch)
        trajectories = await self.client.run_many(self.requests(batch), wait=self.wait_s)
        if version is None:
            version = max((t.policy_version_max for t in trajectories), default=0)
        items = [BatchItem(id=t.job_id, weight=self.plugins.weigh(t, version), trajectory=t) for t in trajectories]
        return self.to_batch(items, batch)

    # -- decoupled: requests into the service's queue, batches out of its buffer ----------------------------
    async def enqueue(self, batch: Any) -> int:
        """Queue `batch`'s episodes as upcoming prompts; the service starts them as admission control allows.
        Returns how many prompts are upcoming now."""
        await self.publish_version(batch)
        return await self.client.enqueue_prompts(self.requests(batch))

    async def take(self, size: int, timeout: float, group_size: int = 1) -> list[BatchItem]:
        """`size` weighed items from the service's buffer, in whole GRPO groups of `group_size`; acknowledge
        them (`ack`) once trained on, or they are delivered again."""
        collector = self._groups.setdefault(group_size, GroupCollector(self.client, group_size))
        return await collector.take(size, timeout)

    async def ack(self, items: list[BatchItem]) -> int:
        return await self.client.ack([item.id for item in items])

    def to_batch(self, items: list[BatchItem], batch: Any = None) -> Any:
        """The backend's batch type for `items` (`prorl_backend_batch`); `batch` is the request they answer."""
        result = self.plugins.hooks.prorl_backend_batch(items=items, batch=batch)
        if result is None:
            raise NoBackend("no backend plugin turns the trajectories into its trainer's batch type")
        return result
