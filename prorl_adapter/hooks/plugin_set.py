"""`PluginSet`: the configured plugins of one process, and the one place where hooks are called and their answers
combined. The service, a trainer's driver and a trainer-side component (verl's sampler, verl's reward function)
each hold one, so the same configuration gives the same verdicts everywhere."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import pluggy

from server_kit.errors import ProrlError

from ..models import AdmissionState, Trajectory, TrajectoryWeight
from ..tasks import TaskHandler
from .manager import PluginLoadError, check_one_backend, collect_tasks, make_plugin_manager

log = logging.getLogger(__name__)


class RewardComponentConflict(ProrlError, ValueError):
    pass


class PluginSet:
    def __init__(self, manager: pluggy.PluginManager, config: Mapping[str, Any] | None = None) -> None:
        self.manager = manager
        self.config = dict(config or {})

    @classmethod
    def load(
        cls,
        config: Mapping[str, Any] | None = None,
        import_paths: Iterable[str] = (),
        objects: Iterable[object] = (),
        blocked: Iterable[str] = (),
        entry_points: bool = True,
    ) -> PluginSet:
        """The installed plugins (entry points), the ones named by import path and the given objects, each
        class instantiated with its section of `config` (`{"staleness": {...}, "reward": {...}}`)."""
        return cls(make_plugin_manager(config, import_paths, objects, blocked, entry_points), config)

    @property
    def hooks(self) -> Any:
        return self.manager.hook

    def register(self, plugin: object, name: str | None = None) -> None:
        """Add `plugin`; refused (and not added) when it would make a second training backend."""
        self.manager.register(plugin, name=name)
        try:
            check_one_backend(self.manager)
        except PluginLoadError:
            self.manager.unregister(plugin)
            raise

    def tasks(self) -> dict[str, TaskHandler]:
        return collect_tasks(self.manager)

    def describe(self) -> list[dict[str, Any]]:
        """Each loaded plugin's name and the hooks it implements (blocked ones have none)."""
        described = []
        for name, plugin in self.manager.list_name_plugin():
            hooks = sorted(h.name for h in self.manager.get_hookcallers(plugin) or []) if plugin is not None else []
            kind = getattr(plugin, "__name__", type(plugin).__name__) if plugin is not None else "blocked"
            described.append({"name": name, "plugin": kind, "hooks": hooks})
        return described

    # -- observers: each implementation on its own, so that one failing never stops the others -------------
    def notify(self, hook: str, **kwargs: Any) -> None:
        """Call every implementation of the observer `hook`, in pluggy's order (the last registered first).
        Observers are plain implementations: hook wrappers are not called."""
        caller = getattr(self.hooks, hook)
        missing = set(caller.spec.argnames) - set(kwargs)
        if missing:  # the caller's bug, not the observer's
            raise TypeError(f"{hook} needs {', '.join(sorted(missing))}")
        for impl in reversed(caller.get_hookimpls()):
            try:
                impl.function(*[kwargs[name] for name in impl.argnames])
            except Exception:  # an observer's bug must not stall the job or the trainer it observes
                log.exception("plugin %r failed in %s", impl.plugin_name, hook)

    # -- decisions ---------------------------------------------------------------------------------------
    def admits(self, state: AdmissionState) -> bool:
        """Every plugin's `prorl_admit_episode`: any False holds the episode back."""
        return not any(verdict is False for verdict in self.hooks.prorl_admit_episode(state=state))

    def expired_before(self, current_version: int) -> int | None:
        """The largest version any plugin says buffered trajectories must not be older than; None: no opinion."""
        thresholds = [v for v in self.hooks.prorl_expired_before(current_version=current_version) if v is not None]
        return max(thresholds, default=None)

    def take_demands(self, state: AdmissionState) -> dict[int, int] | None:
        """Every plugin's `prorl_take_demands` combined: None when none has an opinion (the take serves the
        newest first), else the largest d_j any plugin demands for each version j (ascending)."""
        answers = [d for d in self.hooks.prorl_take_demands(state=state) if d is not None]
        if not answers:
            return None
        combined: dict[int, int] = {}
        for demands in answers:
            for version, count in demands.items():
                combined[version] = max(count, combined.get(version, 0))
        return dict(sorted(combined.items()))

    def weigh(
        self, trajectory: Trajectory, current_version: int, current_logprobs: list[float] | None = None
    ) -> TrajectoryWeight:
        """Every plugin's verdict on consuming `trajectory` at `current_version`, combined: sample weights
        multiply, token weights multiply element-wise, reasons are kept in order."""
        length = len(trajectory.response_ids)
        combined = TrajectoryWeight()
        for weight in self.hooks.prorl_trajectory_weight(
            trajectory=trajectory, current_version=current_version, current_logprobs=current_logprobs
        ):
            if weight is None:
                continue
            combined.sample *= weight.sample
            combined.reasons += weight.reasons
            if weight.tokens is not None:
                if len(weight.tokens) != length:
                    raise ValueError(f"a plugin returned {len(weight.tokens)} token weights for {length} tokens")
                base = combined.tokens or [1.0] * length
                combined.tokens = [a * b for a, b in zip(base, weight.tokens)]
        return combined

    @property
    def reward_on_thread(self) -> bool:
        """Whether shaping a reward calls a plugin that may be slow: one that implements a reward hook and does
        not vouch for it with `quick_reward_hooks = True` (bounded work on the trajectory, no user code)."""
        hooks = (self.hooks.prorl_reward_components, self.hooks.prorl_combine_reward)
        return any(
            not getattr(impl.plugin, "quick_reward_hooks", False) for hook in hooks for impl in hook.get_hookimpls()
        )

    def shaped_reward(
        self,
        trajectory: Trajectory,
        instance: Mapping[str, Any],
        task_components: Mapping[str, float],
        replace_recorded: bool = False,
    ) -> tuple[dict[str, float], float]:
        """The reward components (the task's, then every `prorl_reward_components` plugin's) and the shaped
        reward (`prorl_combine_reward`, else their sum): the service's eval stage and a trainer that scores on
        its own side (verl's reward function) both ask here, so they cannot disagree.

        A component name given twice is an error, except with `replace_recorded`: a trainer recomputing the
        shaping passes the trajectory's recorded components, which already hold the plugins' own.
        """
        components = dict(task_components)
        given: set[str] = set()
        for extra in self.hooks.prorl_reward_components(trajectory=trajectory, instance=dict(instance)):
            for name, value in (extra or {}).items():
                if name in given or (name in components and not replace_recorded):
                    raise RewardComponentConflict(f"reward component {name!r} is given twice (task or plugins)")
                given.add(name)
                components[name] = float(value)
        total = self.hooks.prorl_combine_reward(trajectory=trajectory, components=components)
        return components, float(total) if total is not None else sum(components.values())
