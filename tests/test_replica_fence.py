"""A replica that cannot beat fences itself before the others may take it over (replica.py), in one process: a
coordination whose beats the test lets through or holds unanswered (a partition: the packets vanish), and a job
board and producer that record what the replica told them. With real Redis, namespaces and two replicas:
integration_tests/test_partitions.py."""

from __future__ import annotations

import asyncio

import pytest

from prorl_adapter.service.replica import Replica
from prorl_adapter.service.storage.coordination import BeatReply, MemoryCoordination

INTERVAL_S = 0.05


class CutCoordination(MemoryCoordination):
    """Beats hang while `cut` (no answer ever comes, as behind a partition); once restored they answer, with
    `taken` as Redis would tell it. `others`: replicas alive besides this one, as the last look saw them."""

    shared = True

    def __init__(self, others: int) -> None:
        super().__init__("replica-a")
        self.others = others
        self.link = asyncio.Event()
        self.link.set()
        self.taken = False
        self.beats_sent = 0
        self.beats_answered = 0

    async def beat(self, url, figures, interval_s) -> BeatReply:
        self.beats_sent += 1
        await self.link.wait()
        self.beats_answered += 1
        return BeatReply(taken=self.taken, others_alive=self.others)

    async def claim_dead(self, hold_s: float) -> list[str]:
        return []


class Told:
    """A job board or producer: what the replica told it, in order."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.replicas_alive = log, name, 1

    def fence(self) -> None:
        self.log.append(f"{self.name} fence")

    def unfence(self) -> None:
        self.log.append(f"{self.name} unfence")

    def disown_all(self) -> None:
        self.log.append(f"{self.name} disown")


class Runner:
    def status(self) -> dict:
        return {"active": {}, "episodes_per_s_last_60s": 0.0}


async def until(condition, what: str) -> None:
    async with asyncio.timeout(10):  # a bound on waiting, not a measurement
        while not condition():
            await asyncio.sleep(0.005)
    assert condition(), what


@pytest.fixture
async def replica_with():
    started: list[Replica] = []

    async def start(others: int) -> tuple[Replica, CutCoordination, list[str]]:
        coordination, log = CutCoordination(others), []
        replica = Replica(coordination, Runner(), Told(log, "board"), Told(log, "producer"), None, None, INTERVAL_S)
        await replica.start()
        started.append(replica)
        await until(lambda: replica.producer.replicas_alive == others + 1, "the replica told of the others")
        await until(lambda: coordination.beats_answered >= 2, "the replica beat")
        return replica, coordination, log

    yield start
    for replica in started:
        await replica.stop()


async def test_a_replica_cut_off_fences_itself_within_its_lease_and_drops_its_work_once_told_it_was_taken(
    replica_with,
):
    replica, coordination, log = await replica_with(others=1)
    coordination.link.clear()
    await until(lambda: replica.fenced, "the fence")
    assert log == ["board fence", "producer fence"]
    # Unanswered beats are given up, and later ones sent: the beats go on through the cut.
    sent = coordination.beats_sent
    await until(lambda: coordination.beats_sent > sent + 1, "beats sent during the cut")
    assert replica.fences == 1 and log == ["board fence", "producer fence"]

    coordination.taken = True
    coordination.link.set()
    await until(lambda: not replica.fenced, "the end of the fence")
    assert log == [
        "board fence",
        "producer fence",
        "board disown",
        "producer disown",
        "board unfence",
        "producer unfence",
    ]
    assert replica.figures()["fences"] == 1


async def test_a_replica_not_taken_over_while_fenced_runs_again_what_it_stopped(replica_with):
    replica, coordination, log = await replica_with(others=2)
    coordination.link.clear()
    await until(lambda: replica.fenced, "the fence")
    coordination.link.set()
    await until(lambda: not replica.fenced, "the end of the fence")
    assert log == ["board fence", "producer fence", "board unfence", "producer unfence"]


async def test_a_replica_that_was_told_of_no_other_fences_itself_only_after_the_missed_beats_of_one_alone(
    replica_with,
):
    """Alone at its last beat, nobody can take it over but a replica started since, after ALONE_MISSED_BEATS:
    the replica rides out a cut longer than the usual lease, and fences itself only before that."""
    replica, coordination, log = await replica_with(others=0)
    coordination.link.clear()
    sent = coordination.beats_sent
    await until(lambda: coordination.beats_sent > sent + 1, "beats given up during the cut")  # > 3 beats long
    assert not replica.fenced and log == []
    await until(lambda: replica.fenced, "the fence")
    coordination.link.set()
    await until(lambda: not replica.fenced, "the end of the fence")
    assert log == ["board fence", "producer fence", "board unfence", "producer unfence"]
