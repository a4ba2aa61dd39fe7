"""Staleness control, shared by every training backend.

A trajectory produced at policy version v and consumed by the trainer at version c has staleness s = c - v.
Its version v is that of its oldest token (`policy_version_min`). A turn interrupted by a weight update and
resumed (a partial rollout) has tokens of two versions or more (`Turn.resumptions`, `BatchItem.token_versions`):
the rule is still its oldest token's, for every mode that weighs or paces by versions (`drop`, `linear`,
`pace`): conservative, and pace's bound stays true, as no token is older than its episode's admission. Only
`importance` corrects per token, through each token's own behaviour logprob (the weights that sampled it).
Configured by the `staleness` section of the plugin configuration:

    {"staleness": {"mode": "pace", "max_staleness": 2, "batch_size": 256}}

`mode`:
- `off` (also: no `staleness` section at all): no opinion on anything.
- `drop`: a trajectory with s > K is dropped (sample weight 0); the others keep weight 1.
- `linear`: sample weight max(0, 1 - s/K), a per-sample loss weight (with K = 0: 1 at s = 0, else 0). Note
  that s = K already weighs 0 here, whereas `drop` keeps s = K.
- `pace`: admission control (`prorl_admit_episode`) holds new episodes back so that no trajectory is ever
  consumed with s > K (the rule and why it is right: `should_pace`). Nothing is dropped: dropping stale
  episodes biases training toward the problems that finish fast, pacing slows the producer instead.
- `importance`: drop above K as in `drop`; within K, truncated importance weights per response token,
  w_t = min(cap, exp(current_logprob_t - behaviour_logprob_t)) where the policy sampled token t, 1.0 on tool
  and template tokens. They need the trainer's `current_logprobs`; without them only the drop rule applies
  (a trajectory within K gets no opinion, `None`). Dropping above K stays, because beyond it the ratios are
  mostly truncated and the correction no longer means much.

Keys: `mode` (required), `max_staleness` K (int >= 0, required unless `off`), `importance_cap` (number
>= 1, default 2.0), `batch_size` (trajectories the trainer consumes per policy version; required by `pace`),
`pace_max_in_flight` (optional int >= 1: in `pace`, also never run more episodes at once), `pace_rule` (one of
`PACE_RULES`, default `DEFAULT_PACE_RULE`: the rule pace admits by). A bad value raises `PluginConfigError`
naming `staleness.<key>` and what is allowed.

`pace_rule`:
- `deadline-take` (the default; `deadline_demands`): admits up to (K + 1) * B pending whatever their age, more
  than `any-take` once an old episode is pending, and holds because every take serves deadlines: the plugin
  answers `prorl_take_demands`, so the service's take (`Producer.take_batch`) serves the oldest version first and
  waits, up to the take's timeout, until the batch holds every demand (`deadline_take_ready`); a take that times
  out before returns nothing, or only what meets every demand. What the trainer pays: a take may wait for an
  episode at its limit. It holds when the trainer takes `batch_size` per version, in one take or several (a
  demand larger than a take makes that take wholly of the demanded versions, the oldest first). The default
  because the trainer gets more from it at the same K: `any-take` counts the batch being trained on as pending,
  so at K=1 it admits nothing while a step trains on a batch one version old, and every other step waits for a
  whole generation (docs/benchmarks.md, *Training*).
- `any-take` (`should_pace`): holds whichever finished trajectories the trainer takes, so the service's take
  stays as it is (the newest version first, no waiting), for a trainer whose takes may neither wait nor be
  oldest first.

Registration: the entry point names the class, `prorl_plugins.staleness:StalenessControl`; each plugin set
(the service's, a trainer's) creates its own instance from its `staleness` section. Tests and embedders may
register a `StalenessControl(section)` of their own instead (with the entry point blocked or not loaded:
two instances' verdicts would multiply).

The pure functions `staleness`, `linear_weight`, `truncated_importance_weights`, `should_pace`,
`deadline_demands` and `deadline_take_ready` are the arithmetic, for backends and tests.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from prorl_adapter.hooks import PluginConfigError, hookimpl
from prorl_adapter.models import AdmissionState, Trajectory, TrajectoryWeight
from server_kit.openapi import describe_validation

Mode = Literal["off", "drop", "linear", "pace", "importance"]
PaceRule = Literal["any-take", "deadline-take"]
PACE_RULES: tuple[str, ...] = get_args(PaceRule)
DEFAULT_PACE_RULE: PaceRule = "deadline-take"
SECTION = "staleness"
_MAX_EXP = 709.0  # math.exp overflows above ~709.78


# -- the arithmetic ----------------------------------------------------------------------------------------
def staleness(trajectory_version: int, current_version: int) -> int:
    """How many policy versions old a trajectory produced at `trajectory_version` is at `current_version`."""
    if current_version < trajectory_version:
        raise ValueError(
            f"trajectory version {trajectory_version} is newer than the current policy version {current_version}"
        )
    return current_version - trajectory_version


def linear_weight(s: int, k: int) -> float:
    """max(0, 1 - s/k): 1 for a fresh trajectory, falling to 0 at s = k. With k = 0: 1 at s = 0, else 0."""
    if s < 0 or k < 0:
        raise ValueError(f"staleness {s} and max_staleness {k} must be >= 0")
    if k == 0:
        return 1.0 if s == 0 else 0.0
    return max(0.0, 1.0 - s / k)


def truncated_importance_weights(
    behaviour: Sequence[float], current: Sequence[float], mask: Sequence[int], cap: float
) -> list[float]:
    """Per-token min(cap, exp(current - behaviour)) where `mask` is 1 (policy tokens); 1.0 where it is 0.

    The three sequences are aligned with the response tokens. Raises ValueError on unequal lengths, a mask
    value other than 0/1, or a NaN ratio, because each is a bug upstream that a weight would only hide.
    """
    if not len(behaviour) == len(current) == len(mask):
        raise ValueError(
            f"lengths differ: {len(behaviour)} behaviour logprobs, {len(current)} current logprobs, "
            f"{len(mask)} mask entries"
        )
    weights = []
    for i, (old, new, m) in enumerate(zip(behaviour, current, mask)):
        if m == 0:
            weights.append(1.0)
            continue
        if m != 1:
            raise ValueError(f"response_mask[{i}] is {m!r}; expected 0 or 1")
        diff = new - old
        if math.isnan(diff):
            raise ValueError(f"importance ratio at token {i} is NaN (behaviour {old}, current {new})")
        weights.append(min(cap, math.exp(diff) if diff < _MAX_EXP else math.inf))
    return weights


def should_pace(
    state: AdmissionState,
    k: int,
    batch_size: int,
    max_in_flight: int | None = None,
    rule: str = DEFAULT_PACE_RULE,
) -> bool:
    """True when a new episode must be held back for now, so that no trajectory is consumed with staleness > k.

    `rule` is `deadline-take` (the default, `deadline_demands`: it admits up to (k + 1) * B pending whatever their
    age, and needs the take to serve deadlines) or `any-take` (below: it assumes nothing about which finished
    trajectories the trainer takes).

    The `any-take` rule. Let c be the current version, P the number of pending episodes (in flight + buffered), and
    v_min the oldest version among them and the new episode (which starts at c). Admit iff

        P + 1 <= (v_min + k - c + 1) * batch_size

    Why this bound. The trainer bumps the version once per batch of (at least) B = `batch_size` trajectories.
    The oldest pending episode, started at v_min, must be in one of the batches consumed at versions
    c, c+1, ..., v_min + k: that is (v_min + k - c + 1) batches, (v_min + k - c + 1) * B trajectories. If every
    episode that can still enter those batches besides it -- the other pending ones and any admitted later --
    numbers fewer than that, the trainer cannot fill them all without it, so it is consumed in time. Each
    admission keeps "pending <= (v_min + k - c + 1) * B"; consuming a batch lowers both sides by B (and raises
    the right one further when v_min moves up), so it keeps holding, and after the oldest is consumed the same
    argument covers the next oldest. This holds whatever the episode durations and whichever finished
    trajectories the trainer picks; nothing is ever dropped.
    It is also the loosest such rule: admitting one more would leave (v_min + k - c + 1) * B other episodes,
    and if the oldest one finishes last they fill every batch up to version v_min + k without it.
    It never deadlocks: with fewer than B pending, the invariant gives v_min + k - c + 1 >= 1, so the trainer
    can always be brought to a full batch. With k = 0 it is synchronous training (B episodes, then a step); with
    k it keeps up to (k + 1) * B episodes pending.

    `max_in_flight`, where given, also holds the episode while that many are running.

    Assumes the version counts consumed batches: a batch the trainer has taken must count as buffered until the
    version it is trained at has been bumped (or the pipeline must not admit in between).
    """
    if k < 0 or batch_size < 1:
        raise ValueError(f"max_staleness {k} must be >= 0 and batch_size {batch_size} >= 1")
    if rule not in PACE_RULES:
        raise ValueError(f"pace rule {rule!r} is not one of {', '.join(PACE_RULES)}")
    if max_in_flight is not None and state.running >= max_in_flight:
        return True
    if rule == "deadline-take":
        return state.pending + 1 > (k + 1) * batch_size
    return state.pending + 1 > (state.oldest_version + k - state.current_version + 1) * batch_size


def deadline_demands(state: AdmissionState, k: int, batch_size: int) -> dict[int, int]:
    """What the take at version c must hold for pace's `deadline-take` rule: {j: d_j}, at least d_j of the batch
    of B = `batch_size` at versions <= j, for each j with d_j > 0, where d_j = N(<= j) - (j + k - c) * B and
    N(<= j) counts the pending episodes at versions <= j (`state`: running ones at the version they were
    admitted at, buffered ones at their trajectory's; the previous batch acknowledged, none leased).

    The rule. Admit a new episode iff P + 1 <= (k + 1) * B (P: pending episodes), and let every take at version
    c hold, for every j, at least d_j trajectories of versions <= j, waiting for them to finish where they run
    (`deadline_take_ready`); the rest of the batch may be any finished ones.

    Why no trajectory is consumed with staleness > k. The invariant, at every admission and before every take
    at version c: for all j, N(<= j) <= (j + k - c + 1) * B. For j < c - k the bound is <= 0: nothing pending
    is older than c - k, so whatever the take at c holds has staleness <= k (a trajectory's version is never
    older than the version its episode was admitted at). It holds at the start (nothing pending).
    - Admitting at c adds one episode at level c, so N(<= j) + 1 for j >= c, where N(<= j) = P (nothing pending
      is newer than c): the tightest is j = c, P + 1 <= (k + 1) * B, the rule. Levels below c do not change.
    - An episode that finishes with a trajectory newer than its admission moves up a level: N(<= j) only falls.
    - The take at c removes at least d_j from versions <= j, so afterwards N(<= j) <= (j + k - c) * B, which is
      the invariant at version c + 1 (where d_j <= 0 it held already). Admission may count the taken batch as
      pending until it is acknowledged (the service does): that only holds back more. The demands of the next
      take must not count it: acknowledge before taking again.
    The take is always possible: the invariant gives d_j <= B, and d_j <= N(<= j), so the B oldest pending
    episodes hold min(B, N(<= j)) >= d_j at versions <= j, for every j at once. It never deadlocks: while a
    take waits, admission adds only at level c, which raises d_j for j >= c to at most P - k * B <= B (met by
    any B ready), and lowers nothing it needs; the episodes below c all finish in finite time, after which
    every demand is met by what is ready, and with prompts to admit, P reaches (k + 1) * B >= B, so B are
    ready eventually. With k = 0 it is synchronous training: P <= B and d_c = P, the batch is every pending
    episode.

    Versus `any-take`: its invariant P <= (v_min + k - c + 1) * B implies this one, so `deadline-take`
    admits whenever `any-take` would, and more once an old episode is pending. `any-take` cannot admit more
    without a take like this one: it must hold whichever finished trajectories the trainer takes, and when the
    oldest one finishes last the others fill every batch up to its limit.

    Why no rule that never drops does better, whatever it knows of the durations:
    - Admission. Nothing pending is older than c - k (else it is already too stale) or newer than c, so each
      pending episode, and the new one, must be in one of the takes c, ..., c + k: (k + 1) * B places in all.
      P + 1 <= (k + 1) * B is therefore necessary for every rule, in every state, not only in a worst case;
      this rule admits whenever it holds.
    - The take. The takes after this one, c + 1, ..., j + k, hold (j + k - c) * B, so at least d_j of the
      pending episodes at levels <= j must be in this one, in any schedule: a take that waits only until it
      can meet the demands waits for nothing that another correct take could do without. Serving the oldest
      first leaves the later takes the most room (swapping a younger trajectory of the batch for an older
      ready one never lowers what a later take can meet), so it meets the later demands whenever any choice
      of this batch would.
    What remains is how long the episodes run: the take at c waits for the slowest episode admitted at c - k,
    which no admission rule that starts episodes without knowing their length can shorten. Beyond this, only
    a larger k, dropping (`drop`, `linear`), or restarting episodes buys trainer time.

    What it costs the trainer: a take waits for a running episode only while what is ready cannot meet a
    demand: every episode at its limit (j = c - k), and, for a later j, only as many as the levels up to j hold
    beyond what the takes after this one can still hold before j's limit.

    Why the take must wait: a take that prefers the oldest finished trajectories but waits for none gains
    nothing in the worst case, since younger finished ones fill the batches while an old episode still runs;
    only the `any-take` bound holds for it.
    """
    if k < 0 or batch_size < 1:
        raise ValueError(f"max_staleness {k} must be >= 0 and batch_size {batch_size} >= 1")
    c = state.current_version
    levels = sorted(set(state.in_flight) | set(state.buffered))
    counts = [state.in_flight.get(v, 0) + state.buffered.get(v, 0) for v in levels]
    demands = {}
    for j, at_most_j in zip(levels, accumulate(counts)):
        d = at_most_j - (j + k - c) * batch_size
        if d > 0:
            demands[j] = d
    return demands


def deadline_take_ready(state: AdmissionState, ready: Mapping[int, int], k: int, batch_size: int) -> bool:
    """Whether a take at version `state.current_version` may happen now under pace's `deadline-take` rule: B
    trajectories are ready (`ready`: version -> count, what the take can have) and the B oldest of them meet
    every demand of `deadline_demands`. A take that returns the B oldest ready then holds them."""
    if sum(ready.values()) < batch_size:
        return False
    demands = deadline_demands(state, k, batch_size)
    return all(sum(n for v, n in ready.items() if v <= j) >= d for j, d in demands.items())


# -- configuration -----------------------------------------------------------------------------------------
class StalenessConfig(BaseModel):
    """The validated `staleness` section; what each key means is in the module docstring."""

    # An unknown key is a typo, and a number given as a string or a boolean (`"2"`, `true`) a mistake: JSON and
    # Hydra give numbers as numbers. The section itself may be any mapping (an OmegaConf node among them).
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode
    max_staleness: int | None = Field(None, ge=0, strict=True, validate_default=True)
    importance_cap: float = Field(2.0, ge=1, allow_inf_nan=False, strict=True)
    batch_size: int | None = Field(None, ge=1, strict=True, validate_default=True)
    pace_max_in_flight: int | None = Field(None, ge=1, strict=True)
    pace_rule: PaceRule = DEFAULT_PACE_RULE

    # `mode` is declared first, so it is in `info.data` here when it is valid (when not, only its error is told).
    @field_validator("max_staleness")
    @classmethod
    def _k_unless_off(cls, value: int | None, info: ValidationInfo) -> int | None:
        mode = info.data.get("mode", "off")
        if value is None and mode != "off":
            raise PydanticCustomError("required", f"required in mode {mode!r}")
        return value

    @field_validator("batch_size")
    @classmethod
    def _batch_size_for_pace(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None and info.data.get("mode") == "pace":
            raise PydanticCustomError(
                "required", "required in mode 'pace' (trajectories the trainer consumes per policy version)"
            )
        return value

    @classmethod
    def from_section(cls, section: Any) -> StalenessConfig:
        """Validate the `staleness` section (None: mode off); a bad one raises `PluginConfigError`."""
        if section is None:
            return cls(mode="off")
        try:  # validated under its name, so that each error names the key as written: staleness.max_staleness
            return _SECTION.validate_python({SECTION: section})[SECTION]
        except ValidationError as exc:
            raise PluginConfigError(f"staleness plugin: {describe_validation(exc, _SECTION_TYPE)}") from None


_SECTION_TYPE = dict[str, StalenessConfig]
_SECTION = TypeAdapter(_SECTION_TYPE)


# -- the plugin --------------------------------------------------------------------------------------------
class StalenessControl:
    """The hook implementations; the state is the validated `staleness` section (mode off without one)."""

    config_section = SECTION

    def __init__(self, section: Mapping[str, Any] | None = None) -> None:
        self.config = StalenessConfig.from_section(section)

    @hookimpl
    def prorl_admit_episode(self, state: AdmissionState) -> bool | None:
        c = self.config
        if c.mode != "pace":
            return None
        return not should_pace(state, c.max_staleness, c.batch_size, c.pace_max_in_flight, c.pace_rule)

    @hookimpl
    def prorl_take_demands(self, state: AdmissionState) -> dict[int, int] | None:
        """Pace by `deadline-take`: what the take at `state.current_version` must hold (`deadline_demands`)."""
        c = self.config
        if c.mode != "pace" or c.pace_rule != "deadline-take":
            return None
        return deadline_demands(state, c.max_staleness, c.batch_size)

    @hookimpl
    def prorl_expired_before(self, current_version: int) -> int | None:
        """drop and importance weigh staleness > K as 0, linear staleness >= K: such entries can go."""
        c = self.config
        if c.mode in ("drop", "importance"):
            return current_version - c.max_staleness
        if c.mode == "linear":  # weight 1 - s/K is 0 from s = K (with K = 0: from s = 1)
            return current_version - c.max_staleness + (1 if c.max_staleness > 0 else 0)
        return None

    @hookimpl
    def prorl_trajectory_weight(
        self, trajectory: Trajectory, current_version: int, current_logprobs: list[float] | None
    ) -> TrajectoryWeight | None:
        c = self.config
        if c.mode == "off":
            return None
        s = staleness(trajectory.policy_version_min, current_version)
        k = c.max_staleness
        if c.mode == "pace":
            if s > k:  # only when the pipeline broke pacing's assumptions; kept all the same
                return TrajectoryWeight(reasons=[f"staleness {s} > K={k} despite pacing (kept)"])
            return TrajectoryWeight()
        if c.mode == "linear":
            weight = linear_weight(s, k)
            if weight == 0.0:
                return TrajectoryWeight(sample=0.0, reasons=[f"staleness {s} >= K={k}: dropped (linear weight 0)"])
            reasons = [f"staleness {s} of K={k}: linear weight {weight:.3g}"] if weight < 1.0 else []
            return TrajectoryWeight(sample=weight, reasons=reasons)
        # drop and importance
        if s > k:
            return TrajectoryWeight(sample=0.0, reasons=[f"staleness {s} > K={k}: dropped"])
        if c.mode == "drop":
            return TrajectoryWeight()
        if current_logprobs is None:
            return None
        tokens = truncated_importance_weights(
            trajectory.response_logprobs, current_logprobs, trajectory.response_mask, c.importance_cap
        )
        policy = [w for w, m in zip(tokens, trajectory.response_mask) if m == 1]
        capped = sum(w == c.importance_cap for w in policy)
        reasons = []
        if policy and (capped or any(w != 1.0 for w in policy)):
            reasons.append(
                f"staleness {s}: truncated importance weights on {len(policy)} policy tokens, "
                f"mean {sum(policy) / len(policy):.3g}, {capped} capped at {c.importance_cap:g}"
            )
        return TrajectoryWeight(tokens=tokens, reasons=reasons)
