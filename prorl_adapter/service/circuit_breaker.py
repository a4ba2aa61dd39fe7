"""The circuit breaker: admission pauses when too many of one policy version's episodes misbehave.

A policy under optimisation finds every hole that pays. When, for one policy version, the share of its finished
episodes that show a signal is at least `--breaker-threshold` with 99.9% confidence (`share_lower_bound`; with at
least `--breaker-min-episodes` of them counted), the
breaker trips: POST /v1/jobs answers 503 with the reason, the decoupled producer starts no queued prompt
(`prorl_admit_episode`), and episodes already running finish and are delivered. GET /v1/status (`breaker`) and
/metrics (`prorl_rollout_breaker_tripped`) say why. Only an operator's POST /v1/breaker/reset closes it again.

The signals, each read from the trajectory's artifacts:
- `tampered`: its grading found the test runner tampered with (metrics.TAMPERED_ARTIFACT, the SWE tasks' canary).
- `sandbox_limits`: a tool command was stopped by a sandbox limit's signal (tasks.SANDBOX_LIMITS_ARTIFACT: the
  memory kill, SIGXCPU, SIGXFSZ; not a tool call's own time limit, which honest test suites meet).
- `refused`: the LLM gateway refused requests the episode's sandbox sent it through its forward
  (gateway.REFUSED_ARTIFACT: a flood, fields or tools it does not serve, calls past the turn limit after the
  first, which every harness that runs to its limit makes).

Choices:
- An episode counts for its `policy_version_max`, the newest version that acted in it: a version's count starts
  with its first turns, and what an episode ended up doing (what eval grades) is the newest policy's doing.
- Only episodes in which the policy acted count (a turn at least; cancelled ones never): an episode that failed
  before its first turn says nothing about the policy, and would dilute the share.
- A new policy version does not reset the breaker: the behaviour is the policy's, and a human decides whether
  training goes on (`POST /v1/breaker/reset`). A reset forgets every count, so the version that tripped it starts
  again from zero (its episodes still running count then).
- The breaker is this replica's: replicas sharing a Redis each count what they ran, and each trips alone.

It is a plugin, registered by the service whether or not it is enabled: it always counts the signals (GET
/v1/status, /metrics), and holds admission back only when enabled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from server_kit.errors import ApiError

from ..hooks.specs import hookimpl
from ..models import AdmissionState, BreakerState, BreakerTally, JobState, Trajectory
from ..tasks import SANDBOX_LIMITS_ARTIFACT
from .gateway import REFUSED_ARTIFACT
from .metrics import TAMPERED_ARTIFACT

# signal -> the artifact that shows it
SIGNALS = {"tampered": TAMPERED_ARTIFACT, "sandbox_limits": SANDBOX_LIMITS_ARTIFACT, "refused": REFUSED_ARTIFACT}
VERSIONS_KEPT = 64  # versions counted at once; the oldest is forgotten first
VERSIONS_SHOWN = 8
CONFIDENCE_Z = 3.09  # one-sided 99.9%: the breaker trips on a share it is this sure of (share_lower_bound)


@dataclass
class BreakerConfig:
    threshold: float | None = None  # the share of one version's episodes that trips it; None: off
    min_episodes: int = 20  # episodes of a version counted before its share is weighed
    signals: tuple[str, ...] = tuple(SIGNALS)

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    def check(self) -> None:
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise ValueError(f"--breaker-threshold {self.threshold:g} must be a share in (0, 1]")
        if not isinstance(self.min_episodes, int) or self.min_episodes < 1:
            raise ValueError(f"--breaker-min-episodes {self.min_episodes!r} must be an integer >= 1")
        unknown = sorted(set(self.signals) - set(SIGNALS))
        if unknown or not self.signals:
            raise ValueError(f"--breaker-signals {','.join(self.signals)!r}: name some of {', '.join(SIGNALS)}")


class BreakerOpen(ApiError):
    """The breaker has tripped: no new episode is admitted until an operator resets it."""

    status = 503


def share_lower_bound(flagged: int, episodes: int, z: float = CONFIDENCE_Z) -> float:
    """The lower end of the Wilson score interval of the share `flagged / episodes`: the share the counts show
    at least, at the one-sided confidence `z` stands for. Weighed after every episode of every version, the raw
    share would trip by chance on a policy well below the threshold (simulated with 50 episodes a version,
    weighed from the 20th, at a true share of half the threshold 0.2: 17% of versions trip); this bound trips
    about 1 version in 20,000 there, and still trips by the 20th episode for a true share of 0.5."""
    share = flagged / episodes
    spread = z * math.sqrt(share * (1 - share) / episodes + z * z / (4 * episodes * episodes))
    return (share + z * z / (2 * episodes) - spread) / (1 + z * z / episodes)


def episode_signals(trajectory: Trajectory) -> list[str]:
    """The signals a finished trajectory shows (every one, weighed by the breaker or not)."""
    return [signal for signal, artifact in SIGNALS.items() if artifact in trajectory.artifacts]


@dataclass
class _Tally:
    episodes: int = 0
    flagged: int = 0
    signals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SIGNALS, 0))

    def describe(self, version: int) -> BreakerTally:
        return BreakerTally(version=version, episodes=self.episodes, flagged=self.flagged, signals=dict(self.signals))


@dataclass
class _Trip:
    version: int
    reason: str
    at: float
    tally: BreakerTally


class CircuitBreaker:
    """Counts each version's episodes and their signals (`prorl_job_finished`); holds admission back once tripped
    (`prorl_admit_episode`, and `check_admission` for POST /v1/jobs)."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self._tallies: dict[int, _Tally] = {}
        self._trip: _Trip | None = None
        self.trips = 0
        self.totals = dict.fromkeys(SIGNALS, 0)  # episodes by signal since start (never reset): the metrics' counts

    @property
    def tripped(self) -> bool:
        return self._trip is not None

    @hookimpl
    def prorl_job_finished(self, trajectory: Trajectory, state: JobState) -> None:
        if state is JobState.cancelled or trajectory.num_turns == 0:
            return
        found = episode_signals(trajectory)
        for signal in found:
            self.totals[signal] += 1
        version = trajectory.policy_version_max
        tally = self._tallies.get(version)
        if tally is None:
            tally = self._tallies[version] = _Tally()
            while len(self._tallies) > VERSIONS_KEPT:
                del self._tallies[min(self._tallies)]
        tally.episodes += 1
        for signal in found:
            tally.signals[signal] += 1
        if any(signal in self.config.signals for signal in found):
            tally.flagged += 1
        self._weigh(version, tally)

    @hookimpl
    def prorl_admit_episode(self, state: AdmissionState) -> bool | None:
        return False if self.tripped else None

    def _weigh(self, version: int, tally: _Tally) -> None:
        threshold = self.config.threshold
        if threshold is None or self.tripped or tally.episodes < self.config.min_episodes:
            return
        share = tally.flagged / tally.episodes
        bound = share_lower_bound(tally.flagged, tally.episodes)
        if bound < threshold:
            return
        counts = ", ".join(f"{signal} {tally.signals[signal]}" for signal in self.config.signals)
        reason = (
            f"policy version {version}: {tally.flagged} of {tally.episodes} episodes ({share:.0%}, at least "
            f"{bound:.0%} with 99.9% confidence) showed a signal ({counts}), at or above --breaker-threshold "
            f"{threshold:g}; admission paused until POST /v1/breaker/reset"
        )
        self._trip = _Trip(version, reason, time.time(), tally.describe(version))
        self.trips += 1

    def check_admission(self) -> None:
        """BreakerOpen (503, with the reason) while tripped."""
        if self._trip is not None:
            raise BreakerOpen(f"the circuit breaker has tripped: {self._trip.reason}")

    def reset(self) -> BreakerState:
        """Close the breaker and forget every count (an operator's decision that training may go on)."""
        self._trip = None
        self._tallies.clear()
        return self.describe()

    def describe(self) -> BreakerState:
        trip = self._trip
        return BreakerState(
            enabled=self.config.enabled,
            tripped=trip is not None,
            version=trip.version if trip else None,
            reason=trip.reason if trip else None,
            tripped_at=trip.at if trip else None,
            tally=trip.tally if trip else None,
            threshold=self.config.threshold,
            min_episodes=self.config.min_episodes,
            signals=list(self.config.signals),
            trips=self.trips,
            versions=_newest(self._tallies.items()),
        )


def _newest(tallies: Iterable[tuple[int, _Tally]]) -> list[BreakerTally]:
    ordered = sorted(tallies, key=lambda item: item[0], reverse=True)[:VERSIONS_SHOWN]
    return [tally.describe(version) for version, tally in ordered]
