"""`GroupCollector`: batches from the service's buffer in whole GRPO groups (decoupled mode).

GRPO needs whole groups: a lone sample's advantage would be its raw reward. The collector takes batches until
it holds `size` items in complete groups; items of an incomplete group wait (unacknowledged) for their
siblings. A group can stay incomplete for good: the service does not buffer an episode that failed for an
infrastructure reason, and drops (acknowledges) one its staleness plugin weighed 0. Once the service has
nothing left to produce, incomplete groups of two or more are released as they are; a lone item is
acknowledged unused.
"""

from __future__ import annotations

import time
from collections import defaultdict

from ..models import BatchItem
from .client import RolloutClient


class GroupCollector:
    def __init__(self, client: RolloutClient, group_size: int) -> None:
        self.client = client
        self.group_size = group_size
        self._waiting: dict[str, dict[str, BatchItem]] = defaultdict(dict)

    async def take(self, size: int, timeout: float) -> list[BatchItem]:
        deadline = time.monotonic() + timeout
        while self._count(self.group_size) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the service delivered no full batch of {size} within {timeout:g} s")
            batch = await self.client.take_batch(size, timeout=min(remaining, 5.0))
            for item in batch.items:
                self._waiting[item.group][item.id] = item  # a redelivered item replaces itself
            if not batch.items and await self._production_finished():
                if self._count(2) == 0:
                    raise RuntimeError(f"the service has nothing left to produce: no batch of {size} will come")
                await self._give_up_on_singletons()
                return self._pop_groups(size, minimum=2)
        return self._pop_groups(size, minimum=self.group_size)

    def _count(self, minimum: int) -> int:
        return sum(len(items) for items in self._waiting.values() if len(items) >= minimum)

    def _pop_groups(self, size: int, minimum: int) -> list[BatchItem]:
        taken: list[BatchItem] = []
        for group in [g for g, items in self._waiting.items() if len(items) >= minimum]:
            if len(taken) >= size:
                break
            taken += self._waiting.pop(group).values()
        return taken

    async def _production_finished(self) -> bool:
        status = await self.client.buffer()
        return status.upcoming == 0 and status.in_flight == 0 and status.ready == 0

    async def _give_up_on_singletons(self) -> None:
        lone = [g for g, items in self._waiting.items() if len(items) == 1]
        if lone:
            await self.client.ack([item.id for g in lone for item in self._waiting.pop(g).values()])
