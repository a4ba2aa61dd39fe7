"""Pace's `deadline-take` rule (`prorl_plugins.staleness.deadline_demands`): property tests of its guarantee,
and that its admission is the loosest any rule that never drops can have.

An adversarial discrete-time model: episodes of arbitrary durations and start delays (an episode's trajectory
takes the version at which it starts, at or after the one it was admitted at), admitted whenever `should_pace`
allows; a trainer that takes a batch as soon as `deadline_take_ready` says it may, holding the demanded old
trajectories and otherwise whatever the adversary picks (the newest, random or the oldest finished ones),
trains for a while (its batch still counting as buffered), bumps the version, acknowledges. Checked: no
trajectory is consumed with staleness > K, nothing is lost, nothing deadlocks."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from prorl_adapter.models import AdmissionState
from prorl_plugins.staleness import deadline_demands, deadline_take_ready, should_pace


@dataclass(eq=False)  # compared by identity: two episodes may look alike
class Episode:
    admitted_at: int  # the version it was admitted at (its level while it runs)
    starts: int  # time step at which it starts (and takes the version then)
    ends: int
    version: int | None = None  # its trajectory's version, set when it starts


def pick(ready: list[Episode], demands: dict[int, int], batch_size: int, how: str, rng: random.Random) -> list[Episode]:
    """A batch of `batch_size` from `ready` that holds the demands and otherwise what `how` prefers: the fewest
    old ones the demands allow, then the newest ('newest'), random ones ('random'), or the oldest ('oldest')."""
    if how == "oldest":
        return sorted(ready, key=lambda e: e.version)[:batch_size]
    left = sorted(ready, key=lambda e: (e.version, rng.random()))
    batch: list[Episode] = []
    for j, d in sorted(demands.items()):
        have = sum(e.version <= j for e in batch)
        older = [e for e in left if e.version <= j]
        for e in (older[::-1] if how == "newest" else rng.sample(older, len(older)))[: max(0, d - have)]:
            batch.append(e)
            left.remove(e)
    assert len(batch) <= batch_size, "the demands do not fit one batch"
    rest = left[::-1] if how == "newest" else rng.sample(left, len(left))
    return batch + rest[: batch_size - len(batch)]


def run(
    durations: list[int],
    delays: list[int],
    k: int,
    batch_size: int,
    how: str,
    train_steps: int,
    max_in_flight: int | None,
    seed: int,
) -> tuple[list[int], list[Episode]]:
    """Returns the staleness of every consumed trajectory and the episodes left at the end."""
    rng = random.Random(seed)
    queue = list(zip(durations, delays))
    running: list[Episode] = []
    ready: list[Episode] = []
    leased: list[Episode] = []
    consumed: list[int] = []
    version = t = 0
    training_until: int | None = None
    while True:
        assert t < 200 * (len(durations) + 10), "deadlock: the simulation does not end"
        for e in running:
            if e.version is None and e.starts <= t:
                e.version = version
        ready += [e for e in running if e.ends <= t]
        running = [e for e in running if e.ends > t]
        if training_until is not None and t >= training_until:  # bump the version, then acknowledge
            version += 1
            leased, training_until = [], None
        state = AdmissionState(
            version, Counter(e.admitted_at for e in running), Counter(e.version for e in [*ready, *leased])
        )
        if training_until is None and deadline_take_ready(state, Counter(e.version for e in ready), k, batch_size):
            batch = pick(ready, deadline_demands(state, k, batch_size), batch_size, how, rng)
            assert len(batch) == batch_size
            consumed += [version - e.version for e in batch]
            ready = [e for e in ready if e not in batch]
            leased, training_until = batch, t + train_steps
        while queue:
            state = AdmissionState(
                version, Counter(e.admitted_at for e in running), Counter(e.version for e in [*ready, *leased])
            )
            if should_pace(state, k, batch_size, max_in_flight, rule="deadline-take"):
                break
            duration, delay = queue.pop(0)
            running.append(Episode(version, t + delay, t + delay + duration))
        if not queue and not running and training_until is None and len(ready) < batch_size:
            return consumed, ready
        t += 1


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=80),
    st.lists(st.integers(min_value=0, max_value=4), min_size=80, max_size=80),
    st.integers(min_value=0, max_value=4),
    st.integers(min_value=1, max_value=5),
    st.sampled_from(["newest", "random", "oldest"]),
    st.integers(min_value=0, max_value=6),
    st.one_of(st.none(), st.integers(min_value=1, max_value=12)),
    st.integers(min_value=0, max_value=1000),
)
def test_deadline_take_never_consumes_a_trajectory_older_than_k(
    durations, delays, k, batch_size, how, train_steps, max_in_flight, seed
):
    consumed, left = run(durations, delays[: len(durations)], k, batch_size, how, train_steps, max_in_flight, seed)
    assert len(consumed) + len(left) == len(durations)  # nothing lost
    assert len(left) < batch_size  # only a last partial batch is never taken: no deadlock
    assert max(consumed, default=0) <= k


def test_a_long_straggler_holds_only_the_take_at_its_limit():
    # K = 2, B = 2: one slow episode admitted at 0 among fast ones. The takes go on without it until version 2,
    # its limit, which waits for it: it is trained at s = 2, and none later than that.
    consumed, _ = run([100] + [1] * 19, [0] * 20, 2, 2, "newest", 1, None, 0)
    assert max(consumed) == 2
    assert consumed.count(2) >= 1


@given(
    st.integers(min_value=0, max_value=20),
    st.lists(st.integers(min_value=0, max_value=20), max_size=30),
    st.lists(st.integers(min_value=0, max_value=20), max_size=30),
    st.integers(min_value=0, max_value=5),
    st.integers(min_value=1, max_value=6),
)
def test_deadline_take_admits_whenever_any_take_does(current, in_flight, buffered, k, b):
    state = AdmissionState(
        current, Counter(min(v, current) for v in in_flight), Counter(min(v, current) for v in buffered)
    )
    if not should_pace(state, k, b, rule="any-take"):
        assert not should_pace(state, k, b, rule="deadline-take")


def test_demands_are_the_at_limit_episodes_and_the_overfull_levels():
    # c = 5, K = 2, B = 4: the 3 at version 3 are at their limit; versions <= 4 hold 3 + 4 = 7, of which at most
    # (4 + 2 - 5) * 4 = 4 may be left for the take at 6, so this take holds 3 of them.
    state = AdmissionState(5, {3: 1, 4: 4}, {3: 2, 5: 1})
    assert deadline_demands(state, 2, 4) == {3: 3, 4: 3}
    assert not deadline_take_ready(state, {3: 2, 5: 1}, 2, 4)  # fewer than B ready
    assert not deadline_take_ready(AdmissionState(5, {3: 1, 4: 1}, {3: 2, 4: 3, 5: 1}), {3: 2, 4: 3, 5: 1}, 2, 4)
    assert deadline_take_ready(AdmissionState(5, {4: 1}, {3: 3, 4: 3, 5: 1}), {3: 3, 4: 3, 5: 1}, 2, 4)


def schedulable(state: AdmissionState, k: int, batch_size: int) -> bool:
    """Whether every pending episode could still be consumed within k, in the kindest case: all of them finished
    now, the takes c, c + 1, ... of `batch_size` each filled earliest deadline first."""
    deadlines = sorted(v + k for v, n in (state.in_flight + state.buffered).items() for _ in range(n))
    return all(deadline >= state.current_version + i // batch_size for i, deadline in enumerate(deadlines))


@given(
    st.integers(min_value=0, max_value=20),
    st.lists(st.integers(min_value=0, max_value=4), max_size=40),
    st.lists(st.integers(min_value=0, max_value=4), max_size=40),
    st.integers(min_value=0, max_value=4),
    st.integers(min_value=1, max_value=6),
)
def test_deadline_take_admits_exactly_when_any_rule_could(current, in_flight_ages, buffered_ages, k, b):
    # Reachable states only: nothing pending older than c - k, and the levels within what the rule keeps.
    state = AdmissionState(
        current,
        Counter(current - min(age, k) for age in in_flight_ages),
        Counter(current - min(age, k) for age in buffered_ages),
    )
    if not schedulable(state, k, b):
        return
    with_one_more = AdmissionState(current, state.in_flight + Counter({current: 1}), state.buffered)
    # No rule, whatever it knew of the durations, could admit where even the kindest case fails; this one
    # admits wherever it does not.
    assert should_pace(state, k, b, rule="deadline-take") == (not schedulable(with_one_more, k, b))
