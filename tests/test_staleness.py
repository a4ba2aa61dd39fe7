"""The staleness plugin: its arithmetic (property tests), its configuration errors, its hooks through a real
plugin set, and a simulation of decoupled training showing why pacing beats dropping."""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prorl_adapter.hooks import PluginConfigError, PluginSet, hookimpl
from prorl_adapter.models import AdmissionState, Trajectory, TrajectoryWeight
from prorl_adapter.trainer.samples import trajectory_from_tensors
from prorl_plugins.staleness import (
    StalenessControl,
    linear_weight,
    should_pace,
    staleness,
    truncated_importance_weights,
)

versions = st.integers(min_value=0, max_value=10_000)
ks = st.integers(min_value=0, max_value=50)
logprobs = st.floats(min_value=-30.0, max_value=0.0)
caps = st.floats(min_value=1.0, max_value=100.0)


def admission(current: int, in_flight: list[int], buffered: list[int]) -> AdmissionState:
    """The state admission control sees, from one version per running episode and per buffered trajectory."""
    return AdmissionState(current, Counter(in_flight), Counter(buffered))


def make_trajectory(version: int, mask=(1, 1, 0, 1), behaviour=None, job_id: str = "j", task: str = "t") -> Trajectory:
    mask = list(mask)
    logprobs = list(behaviour) if behaviour is not None else [-1.0 if m else 0.0 for m in mask]
    ids = list(range(len(mask)))
    return trajectory_from_tensors([1, 2], ids, mask, logprobs, version, version, job_id=job_id, task=task)


def plugin_set(section: dict | None) -> PluginSet:
    """The staleness plugin alone, created by its import path from the `staleness` section (none: no section)."""
    config = {} if section is None else {"staleness": section}
    return PluginSet.load(config, import_paths=["prorl_plugins.staleness:StalenessControl"], entry_points=False)


# -- arithmetic --------------------------------------------------------------------------------------------
@given(versions, st.integers(min_value=0, max_value=100))
def test_staleness_is_the_version_difference(v, d):
    assert staleness(v, v + d) == d


@given(versions, st.integers(min_value=1, max_value=100))
def test_staleness_refuses_a_trajectory_from_the_future(v, d):
    with pytest.raises(ValueError, match="newer"):
        staleness(v + d, v)


@given(st.integers(min_value=0, max_value=200), ks)
def test_linear_weight_is_in_unit_interval_and_non_increasing(s, k):
    w = linear_weight(s, k)
    assert 0.0 <= w <= 1.0
    assert linear_weight(s + 1, k) <= w


@given(ks, st.integers(min_value=0, max_value=100))
def test_linear_weight_is_one_when_fresh_and_zero_from_k_on(k, extra):
    assert linear_weight(0, k) == 1.0
    assert linear_weight(k + extra, k) == (1.0 if k + extra == 0 else 0.0)


def test_linear_weight_values():
    assert linear_weight(1, 4) == 0.75
    assert linear_weight(0, 0) == 1.0
    assert linear_weight(1, 0) == 0.0


@given(versions, st.integers(min_value=0, max_value=60), ks)
def test_drop_mode_drops_iff_staleness_exceeds_k(v, s, k):
    plugin = StalenessControl({"mode": "drop", "max_staleness": k})
    verdict = plugin.prorl_trajectory_weight(make_trajectory(v), v + s, None)
    assert verdict.sample == (0.0 if s > k else 1.0)
    assert bool(verdict.reasons) == (s > k)


@given(versions, st.integers(min_value=0, max_value=60), st.integers(min_value=0, max_value=60), ks)
def test_sample_weight_never_grows_with_staleness(v, s1, s2, k):
    lo, hi = sorted((s1, s2))
    for mode in ("drop", "linear"):
        plugin = StalenessControl({"mode": mode, "max_staleness": k})
        fresher = plugin.prorl_trajectory_weight(make_trajectory(v), v + lo, None).sample
        staler = plugin.prorl_trajectory_weight(make_trajectory(v), v + hi, None).sample
        assert 0.0 <= staler <= fresher <= 1.0


@st.composite
def aligned_logprobs(draw):
    n = draw(st.integers(min_value=0, max_value=40))
    behaviour = draw(st.lists(logprobs, min_size=n, max_size=n))
    current = draw(st.lists(logprobs, min_size=n, max_size=n))
    mask = draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n))
    return behaviour, current, mask


@given(aligned_logprobs(), caps)
def test_importance_weights_are_truncated_ratios_on_policy_tokens(data, cap):
    behaviour, current, mask = data
    weights = truncated_importance_weights(behaviour, current, mask, cap)
    assert len(weights) == len(mask)
    for w, old, new, m in zip(weights, behaviour, current, mask):
        assert 0.0 <= w <= cap
        if m == 0:
            assert w == 1.0
        elif math.exp(new - old) < cap:
            assert w == math.exp(new - old)
        else:
            assert w == cap


def test_importance_weights_do_not_overflow_and_reject_bugs():
    assert truncated_importance_weights([-1000.0, 0.0], [0.0, -1000.0], [1, 1], 2.0) == [2.0, math.exp(-1000.0)]
    with pytest.raises(ValueError, match="lengths differ"):
        truncated_importance_weights([0.0], [0.0, 0.0], [1], 2.0)
    with pytest.raises(ValueError, match="expected 0 or 1"):
        truncated_importance_weights([0.0], [0.0], [2], 2.0)
    with pytest.raises(ValueError, match="NaN"):
        truncated_importance_weights([0.0], [math.nan], [1], 2.0)


# -- pacing: the rule's guarantee, against adversarial durations and trainer orders -----------------------
def run_paced(durations: list[int], k: int, batch_size: int, order: str, seed: int = 0) -> list[int]:
    """Start episodes (of the given durations, in order) whenever `should_pace` allows; the trainer consumes
    any `batch_size` finished ones (newest, oldest or random first) and bumps the version. Returns the
    staleness of every consumed trajectory."""
    rng = random.Random(seed)
    queue = deque(durations)
    running: list[tuple[int, int]] = []  # (end time, version)
    buffered: list[int] = []
    consumed: list[int] = []
    version = t = 0
    while queue or running or buffered:
        assert t < 100 * (len(durations) + 10), "pacing deadlocked"
        buffered += [v for end, v in running if end <= t]
        running = [(end, v) for end, v in running if end > t]
        while len(buffered) >= batch_size:
            if order == "random":
                rng.shuffle(buffered)
            else:
                buffered.sort(reverse=order == "newest")
            batch, buffered = buffered[:batch_size], buffered[batch_size:]
            consumed += [staleness(v, version) for v in batch]
            version += 1
        while queue:
            state = admission(version, [v for _, v in running], list(buffered))
            if should_pace(state, k, batch_size, rule="any-take"):
                break
            running.append((t + queue.popleft(), version))
        if not queue and not running and 0 < len(buffered) < batch_size:
            break  # a last partial batch the trainer never takes
        t += 1
    return consumed


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=60),
    st.integers(min_value=0, max_value=4),
    st.integers(min_value=1, max_value=5),
    st.sampled_from(["newest", "oldest", "random"]),
    st.integers(min_value=0, max_value=1000),
)
def test_pacing_never_lets_a_trajectory_exceed_k(durations, k, batch_size, order, seed):
    durations = durations[: len(durations) // batch_size * batch_size] or [1] * batch_size
    consumed = run_paced(durations, k, batch_size, order, seed)
    assert len(consumed) == len(durations)  # nothing lost, no deadlock
    assert max(consumed) <= k


@given(ks, st.integers(min_value=1, max_value=8))
def test_pacing_admits_k_plus_one_batches_when_nothing_is_old(k, b):
    def held(pending: int) -> bool:
        return should_pace(admission(10, [10] * pending, []), k, b, rule="any-take")

    assert not held((k + 1) * b - 1)
    assert held((k + 1) * b)


def test_pacing_holds_while_the_oldest_is_at_its_limit():
    # The oldest pending episode started at 3; at version 5 with K=2 the next batch is its last chance, so only
    # a batch's worth of episodes may be pending.
    assert not should_pace(admission(5, [3], [5, 5]), 2, 4, rule="any-take")
    assert should_pace(admission(5, [3], [5, 5, 5]), 2, 4, rule="any-take")
    assert should_pace(admission(6, [3], []), 2, 4, rule="any-take")
    assert should_pace(admission(5, [5, 5], []), 2, 100, max_in_flight=2)


# -- configuration -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"mode": "sometimes", "max_staleness": 2}, "mode"),
        ({"max_staleness": 2}, "mode"),
        ({"mode": "drop"}, "max_staleness"),
        ({"mode": "drop", "max_staleness": -1}, "max_staleness"),
        ({"mode": "drop", "max_staleness": 1.5}, "max_staleness"),
        ({"mode": "drop", "max_staleness": "2"}, "max_staleness"),
        ({"mode": "drop", "max_staleness": True}, "max_staleness"),
        ({"mode": "importance", "max_staleness": 2, "importance_cap": 0.5}, "importance_cap"),
        ({"mode": "importance", "max_staleness": 2, "importance_cap": math.inf}, "importance_cap"),
        ({"mode": "importance", "max_staleness": 2, "importance_cap": "2"}, "importance_cap"),
        ({"mode": "pace", "max_staleness": 2}, "batch_size"),
        ({"mode": "pace", "max_staleness": 2, "batch_size": 0}, "batch_size"),
        ({"mode": "pace", "max_staleness": 2, "batch_size": 4, "pace_max_in_flight": 0}, "pace_max_in_flight"),
        ({"mode": "pace", "max_staleness": 2, "batch_size": 4, "pace_rule": "oldest"}, "pace_rule"),
        ({"mode": "pace", "max_staleness": 2, "batch_size": 4, "pace_rule": None}, "pace_rule"),
        ({"mode": "pace", "max_staleness": 2, "batch_size": 4, "pace_rule": ["deadline-take"]}, "pace_rule"),
        ({"mode": "drop", "max_staleness": 2, "max_stalenes": 3}, "max_stalenes"),
    ],
)
def test_a_bad_key_is_named(section, key):
    with pytest.raises(PluginConfigError, match=rf"staleness\.{key}\b") as info:
        plugin_set(section)
    message = str(info.value)
    assert "should be" in message or "required" in message or "not permitted" in message


def test_bad_configuration_messages_say_what_is_allowed():
    with pytest.raises(PluginConfigError, match="should be 'off', 'drop', 'linear', 'pace' or 'importance'"):
        plugin_set({"mode": "sometimes"})
    with pytest.raises(PluginConfigError, match=r"staleness\.k: Extra inputs are not permitted \(known: .*max_stal"):
        plugin_set({"mode": "off", "k": 1})
    with pytest.raises(PluginConfigError, match="staleness: Input should be a valid dictionary"):
        plugin_set("drop")
    with pytest.raises(PluginConfigError, match=r"staleness\.pace_rule: Input should be 'any-take' or 'deadline-take'"):
        plugin_set({"mode": "pace", "max_staleness": 2, "batch_size": 4, "pace_rule": "deadline"})


def test_off_and_no_section_have_no_opinion():
    for section in (None, {"mode": "off"}):
        plugins = plugin_set(section)
        hooks = plugins.hooks
        assert (
            hooks.prorl_trajectory_weight(trajectory=make_trajectory(0), current_version=9, current_logprobs=None) == []
        )
        assert hooks.prorl_admit_episode(state=admission(9, [0] * 100, [])) == []
        assert plugins.weigh(make_trajectory(0), 9) == TrajectoryWeight()
        assert plugins.admits(admission(9, [0] * 100, [])) and plugins.expired_before(9) is None


# -- the hooks through a plugin set --------------------------------------------------------------------------
def test_drop_through_a_plugin_set():
    plugins = plugin_set({"mode": "drop", "max_staleness": 2})
    kept = plugins.weigh(make_trajectory(5), current_version=7)
    dropped = plugins.weigh(make_trajectory(4), current_version=7)
    assert (kept.sample, kept.reasons) == (1.0, [])
    assert dropped.sample == 0.0
    assert dropped.reasons == ["staleness 3 > K=2: dropped"]


def test_linear_through_a_plugin_set():
    plugins = plugin_set({"mode": "linear", "max_staleness": 4})
    w = plugins.weigh(make_trajectory(2), current_version=3)
    assert w.sample == 0.75
    assert w.reasons == ["staleness 1 of K=4: linear weight 0.75"]
    w = plugins.weigh(make_trajectory(2), current_version=6)
    assert w.sample == 0.0
    assert "dropped" in w.reasons[0]


def test_importance_through_a_plugin_set():
    plugins = plugin_set({"mode": "importance", "max_staleness": 2, "importance_cap": 2.0})
    trajectory = make_trajectory(3, mask=[1, 1, 0, 1], behaviour=[-1.0, -2.0, 0.0, -3.0])
    w = plugins.weigh(trajectory, 4, current_logprobs=[-1.5, -0.5, -7.0, -3.0])
    assert w.sample == 1.0
    assert w.tokens == [math.exp(-0.5), 2.0, 1.0, 1.0]
    assert "1 capped at 2" in w.reasons[0]
    # without the trainer's logprobs: no opinion within K, still dropped above it
    assert plugins.hooks.prorl_trajectory_weight(trajectory=trajectory, current_version=4, current_logprobs=None) == []
    assert plugins.weigh(trajectory, 6).sample == 0.0
    with pytest.raises(ValueError, match="lengths differ"):
        plugins.weigh(trajectory, 4, current_logprobs=[0.0])


def test_pace_through_a_plugin_set_admits_and_never_drops():
    plugins = plugin_set({"mode": "pace", "max_staleness": 2, "batch_size": 4, "pace_rule": "any-take"})
    assert plugins.admits(admission(5, [3], [5, 5]))
    assert not plugins.admits(admission(5, [3], [5, 5, 5]))
    w = plugins.weigh(make_trajectory(0), current_version=9)
    assert w.sample == 1.0
    assert "despite pacing (kept)" in w.reasons[0]


def test_pace_deadline_take_admits_k_plus_one_batches_whatever_their_age():
    # The episode at 3 is at its limit at version 5: any-take admits 4 pending, deadline-take 12 (its take
    # holds the one at 3, `deadline_demands`).
    assert not should_pace(admission(5, [3], [5] * 10), 2, 4, rule="deadline-take")
    assert should_pace(admission(5, [3], [5] * 11), 2, 4, rule="deadline-take")
    assert should_pace(admission(5, [3], [5] * 10), 2, 4, rule="any-take")
    assert not should_pace(admission(5, [3], [5] * 10), 2, 4)  # deadline-take, the default
    with pytest.raises(ValueError, match="pace rule"):
        should_pace(admission(5, [], []), 2, 4, rule="oldest")


def test_pace_rule_deadline_take_through_a_plugin_set_admits_more_and_demands_deadline_takes():
    deadline = plugin_set({"mode": "pace", "max_staleness": 2, "batch_size": 4, "pace_rule": "deadline-take"})
    state = admission(5, [3], [5] * 10)
    assert deadline.admits(state) and not deadline.admits(admission(5, [3], [5] * 11))
    assert deadline.take_demands(state) == {3: 1, 5: 3}  # the one at 3 is at its limit; 11 pending at <= 5
    assert deadline.take_demands(admission(5, [], [])) == {}  # serves deadlines, nothing demanded now
    default = plugin_set({"mode": "pace", "max_staleness": 2, "batch_size": 4})
    assert default.admits(state) and default.take_demands(state) == {3: 1, 5: 3}  # deadline-take, the default
    any_take = plugin_set({"mode": "pace", "max_staleness": 2, "batch_size": 4, "pace_rule": "any-take"})
    assert not any_take.admits(state)
    for plugins in (any_take, plugin_set({"mode": "drop", "max_staleness": 2, "pace_rule": "deadline-take"})):
        assert plugins.take_demands(state) is None  # the take stays newest first, waiting for nothing


def test_take_demands_of_several_plugins_combine_to_the_largest_per_version():
    class Demands:
        def __init__(self, demands):
            self.demands = demands

        @hookimpl
        def prorl_take_demands(self, state):
            return self.demands

    plugins = PluginSet.load(objects=[Demands({3: 1, 5: 2}), Demands(None), Demands({5: 4, 4: 1})], entry_points=False)
    assert plugins.take_demands(admission(5, [], [])) == {3: 1, 4: 1, 5: 4}
    assert PluginSet.load(objects=[Demands(None)], entry_points=False).take_demands(admission(5, [], [])) is None


@pytest.mark.parametrize(
    ("section", "expired_before"),
    [
        ({"mode": "drop", "max_staleness": 2}, 8),  # s > 2 weighs 0: older than 8 at version 10
        ({"mode": "importance", "max_staleness": 2}, 8),
        ({"mode": "linear", "max_staleness": 2}, 9),  # s >= 2 weighs 0
        ({"mode": "linear", "max_staleness": 0}, 10),
        ({"mode": "pace", "max_staleness": 2, "batch_size": 4}, None),  # pacing never expires anything
    ],
)
def test_what_weighs_zero_expires(section, expired_before):
    plugins = plugin_set(section)
    assert plugins.expired_before(10) == expired_before
    if expired_before is not None:
        assert plugins.weigh(make_trajectory(expired_before - 1), 10).sample == 0.0
        assert plugins.weigh(make_trajectory(expired_before), 10).sample > 0.0


def test_the_entry_point_creates_one_instance_per_plugin_set_from_its_section():
    # Two configurations in one process: a service and a trainer-side component, or two tests.
    dropping = PluginSet.load({"staleness": {"mode": "drop", "max_staleness": 0}})
    weighing = PluginSet.load({"staleness": {"mode": "linear", "max_staleness": 4}})
    off = PluginSet.load()
    plugins = [s.manager.get_plugin("staleness") for s in (dropping, weighing, off)]
    assert all(type(p) is StalenessControl for p in plugins) and len({id(p) for p in plugins}) == 3
    assert [p.config.mode for p in plugins] == ["drop", "linear", "off"]
    assert [s.weigh(make_trajectory(0), 1).sample for s in (dropping, weighing, off)] == [0.0, 0.75, 1.0]


# -- a simulation of decoupled training: pacing keeps the slow tasks that dropping loses -----------------
@dataclass
class SimResult:
    submitted: list[str] = field(default_factory=list)  # the kind of each episode started
    trained: list[str] = field(default_factory=list)  # the kind of each consumed trajectory with weight > 0
    staleness: list[int] = field(default_factory=list)  # of every consumed trajectory
    steps: int = 0

    def slow_fraction(self, kinds: list[str]) -> float:
        return kinds.count("slow") / len(kinds)


def simulate(section: dict, workers: int = 16, batch_size: int = 4, duration: int = 400) -> SimResult:
    """Discrete time. Tasks arrive as an endless stream, every 4th slow (6 time units) and the rest fast (1);
    up to `workers` episodes run at once, each started when every `prorl_admit_episode` agrees. The trainer
    consumes the first `batch_size` finished trajectories whenever it has them, weighs each through
    `PluginSet.weigh`, trains on those with weight > 0 and bumps the policy version."""
    plugins = plugin_set(section)
    lengths = {"fast": 1, "slow": 6}
    result = SimResult()
    running: list[tuple[int, int, str]] = []  # (end time, version, kind)
    buffer: deque[tuple[int, str]] = deque()
    version = 0
    for t in range(duration):
        buffer.extend((v, kind) for end, v, kind in running if end == t)
        running = [r for r in running if r[0] > t]
        while len(buffer) >= batch_size:
            for _ in range(batch_size):
                v, kind = buffer.popleft()
                weight = plugins.weigh(make_trajectory(v, task=kind), version)
                result.staleness.append(staleness(v, version))
                if weight.sample > 0:
                    result.trained.append(kind)
            version += 1
            result.steps += 1
        while len(running) < workers:
            state = admission(version, [v for _, v, _ in running], [v for v, _ in buffer])
            if not plugins.admits(state):
                break
            kind = "slow" if len(result.submitted) % 4 == 3 else "fast"
            result.submitted.append(kind)
            running.append((t + lengths[kind], version, kind))
    return result


def test_pacing_keeps_slow_tasks_that_dropping_loses():
    k, b = 2, 4
    dropped = simulate({"mode": "drop", "max_staleness": k, "batch_size": b}, batch_size=b)
    # The simulated trainer takes the first finished, not a take that serves deadlines: any-take is its rule.
    paced = simulate({"mode": "pace", "max_staleness": k, "batch_size": b, "pace_rule": "any-take"}, batch_size=b)

    submitted = dropped.slow_fraction(dropped.submitted)
    assert submitted == pytest.approx(0.25, abs=0.01)
    # dropping: slow episodes come back too stale and (almost) never reach the loss
    assert max(dropped.staleness) > k
    assert dropped.slow_fraction(dropped.trained) < 0.1 * submitted

    # pacing: every trajectory is trained on, none beyond K, and the slow ones keep their share
    assert paced.steps >= 50
    assert len(paced.trained) == len(paced.staleness)
    assert max(paced.staleness) <= k
    assert paced.slow_fraction(paced.trained) == pytest.approx(paced.slow_fraction(paced.submitted), abs=0.02)
    assert paced.slow_fraction(paced.submitted) == pytest.approx(0.25, abs=0.01)


@given(st.integers(min_value=0, max_value=20), st.integers(min_value=1, max_value=5), ks)
def test_a_turn_resumed_under_newer_weights_is_as_stale_as_its_oldest_token(v, newer, k):
    """The stated rule for a partial rollout (tokens of several versions): drop, linear and pace go by the oldest
    token, so resuming a turn under new weights never makes it look fresher than its first tokens."""
    resumed = make_trajectory(v).model_copy(update={"policy_version_max": v + newer})
    for mode in ("drop", "linear"):
        plugin = StalenessControl({"mode": mode, "max_staleness": k})
        current = v + newer + 1
        assert plugin.prorl_trajectory_weight(resumed, current, None) == plugin.prorl_trajectory_weight(
            make_trajectory(v), current, None
        )
