"""The `prorl` section SkyRL's config gains, and the checks that make a wrong one fail before training starts.

SkyRL builds its config from typed dataclasses and rejects unknown keys, so the section is a dataclass too and
`ProRLSkyRLConfig` is SkyRL's config with it added (SkyRL's documented way to add fields: subclass the config).
Only what SkyRL has no field for is here; the rest is SkyRL's own: `generator.max_turns` and
`generator.max_input_length` bound each episode, `generator.sampling_params` sets each turn's sampling,
`environment.env_class` names the task when the dataset has no `env_class` column.

(No `from __future__ import annotations` in this module: SkyRL resolves the field types at run time.)
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl.train.config import BaseConfig, SkyRLTrainConfig

from prorl_adapter.hooks.manager import read_plugin_config

from . import compat  # noqa: F401  (before the first skyrl import)

# Generator options whose work SkyRL's own generator does and this one does not: refused rather than ignored.
UNSUPPORTED_GENERATOR_OPTIONS = {
    "step_wise_trajectories": "one row per episode is emitted, not one per turn",
    "merge_stepwise_output": "one row per episode is emitted, not one per turn",
    "vision_language_generator": "the rollout service is text-only",
    "apply_overlong_filtering": "use the staleness/reward plugins or max_context on the service side",
    "zero_reward_on_non_stop": "shape rewards with the reward plugin instead",
}


@dataclass
class ProRLConfig(BaseConfig):
    rollout_url: str | None = None
    """The rollout service, e.g. http://rollout:8766 (required)."""
    token: str | None = None
    """The service's bearer token, if it has one."""
    plugin_config: dict[str, Any] = field(default_factory=dict)
    """The plugin configuration the service was started with (`{"staleness": {...}, "reward": {...}}`)..."""
    plugin_config_file: str | None = None
    """...or the same JSON file as the service's --plugin-config (one of the two)."""
    plugins: list[str] = field(default_factory=list)
    """Extra plugins to load in the trainer's process, as import paths (as the service's --plugin)."""
    timeout_s: float | None = None
    """Budget for each episode's init + run + eval on the service (None: the service's default)."""
    wait_s: float = 3600.0
    """How long the generator waits for one batch's episodes."""


@dataclass
class ProRLSkyRLConfig(SkyRLTrainConfig):
    prorl: ProRLConfig = field(default_factory=ProRLConfig)


def plugin_config(prorl: ProRLConfig) -> dict:
    """The plugin configuration, from the section or from its file; both given is an error."""
    if prorl.plugin_config and prorl.plugin_config_file:
        raise ValueError("set prorl.plugin_config or prorl.plugin_config_file, not both")
    if prorl.plugin_config_file:
        return read_plugin_config(Path(prorl.plugin_config_file))
    return dict(prorl.plugin_config)


def check(cfg: Any) -> ProRLConfig:
    """The `prorl` section of a SkyRL config, checked; raises ValueError saying what to fix."""
    prorl = getattr(cfg, "prorl", None)
    if not isinstance(prorl, ProRLConfig):
        raise ValueError(
            "the SkyRL config has no `prorl` section: build it with prorl_plugins.skyrl.config.ProRLSkyRLConfig "
            "(or run SkyRL with trainer.override_entrypoint=prorl_plugins.skyrl.entrypoint)"
        )
    if not prorl.rollout_url or not prorl.rollout_url.startswith(("http://", "https://")):
        raise ValueError(f"prorl.rollout_url must be the rollout service's http(s) URL, got {prorl.rollout_url!r}")
    if prorl.wait_s <= 0 or (prorl.timeout_s is not None and prorl.timeout_s <= 0):
        raise ValueError(f"prorl.wait_s ({prorl.wait_s}) and prorl.timeout_s ({prorl.timeout_s}) must be > 0")
    for option, why in UNSUPPORTED_GENERATOR_OPTIONS.items():
        if getattr(cfg.generator, option, False):
            raise ValueError(f"generator.{option}=true is not supported with the rollout service: {why}")
    return prorl
