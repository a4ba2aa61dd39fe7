"""The `prorl` block of a verl config, and the check that the plugin lines around it agree.

A user adds to a working verl GRPO recipe:

    actor_rollout_ref.model.external_lib=prorl_plugins.verl
    actor_rollout_ref.rollout.agent.default_agent_loop=prorl_agent
    +prorl.service_url=http://rollout-host:8766 +prorl.task=python_math

and, for staleness control or verl-side reward shaping, the lines `verl_lines()` prints. Everything here fails
with a `ProrlVerlConfigError` naming the key and what to write instead, at the first rollout of every agent
loop worker (and in `python -m prorl_plugins.verl.check`, before any GPU is touched).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from prorl_adapter.hooks.specs import PluginConfigError
from prorl_adapter.models import SamplingParams
from prorl_adapter.trainer.samples import TrainerPlugins
from prorl_plugins.reward_shaping import RewardShaping
from prorl_plugins.staleness import StalenessConfig, StalenessControl

AGENT_LOOP_NAME = "prorl_agent"
PLUGIN_MODULE = "prorl_plugins.verl"
SAMPLER_PATH = "pkg://prorl_plugins.verl.sampler"
SAMPLER_NAME = "StalenessReplayBuffer"
REWARD_PATH = "pkg://prorl_plugins.verl.reward"
REWARD_NAME = "compute_score"
BLOCK = "prorl"
REWARD_SOURCES = ("service", "verl")
# verl's rollout sampling settings win over the block's: one place per setting.
_VERL_OWNED_SAMPLING = {
    "temperature": "actor_rollout_ref.rollout.temperature",
    "top_p": "actor_rollout_ref.rollout.top_p",
}
_KEYS = (
    "service_url",
    "sandbox_url",
    "token",
    "task",
    "llm_servers",
    "sampling",
    "max_turns",
    "max_context_tokens",
    "timeout_s",
    "reward_source",
    "staleness",
    "reward",
)


class ProrlVerlConfigError(ValueError):
    """A wrong plugin line; the message names the verl config key and what to write."""


def _url(value: Any, key: str) -> str:
    parsed = urlparse(value) if isinstance(value, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ProrlVerlConfigError(f"{key}={value!r} is not an http(s) URL; write e.g. {key}=http://127.0.0.1:8766")
    try:
        parsed.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError as exc:
        raise ProrlVerlConfigError(f"{key}={value!r} has a bad port: {exc}") from exc
    return value.rstrip("/")


def _positive_int(value: Any, key: str, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProrlVerlConfigError(f"{key}={value!r} must be an integer > 0")
    return value


@dataclass(frozen=True)
class ProrlVerlConfig:
    """The validated `prorl` block."""

    service_url: str
    task: str
    sandbox_url: str | None = None
    token: str | None = None
    llm_servers: tuple[str, ...] | None = None  # None: verl's own vLLM replicas
    sampling: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8
    max_context_tokens: int | None = None  # None: verl's prompt_length + response_length
    timeout_s: float | None = None
    reward_source: str = "service"
    staleness: dict[str, Any] | None = None
    reward: dict[str, Any] | None = None

    @classmethod
    def from_block(cls, block: Any) -> ProrlVerlConfig:
        if block is None:
            raise ProrlVerlConfigError(
                f"the {AGENT_LOOP_NAME!r} agent loop needs a `{BLOCK}` block in the verl config; add at least "
                f"+{BLOCK}.service_url=http://<rollout-host>:<port> +{BLOCK}.task=<task name, e.g. python_math>"
            )
        if isinstance(block, DictConfig):
            block = OmegaConf.to_container(block, resolve=True)
        if not isinstance(block, Mapping):
            raise ProrlVerlConfigError(f"`{BLOCK}` must be a mapping of settings, got {block!r}")
        for key in block:
            if key not in _KEYS:
                raise ProrlVerlConfigError(f"unknown key {BLOCK}.{key}; known keys: {', '.join(_KEYS)}")
        if block.get("service_url") is None:
            raise ProrlVerlConfigError(
                f"{BLOCK}.service_url is missing: add +{BLOCK}.service_url=http://<rollout-host>:<port> "
                "(the rollout service, started with `prorl-rollout`)"
            )
        if not isinstance(block.get("task"), str) or not block["task"]:
            raise ProrlVerlConfigError(
                f"{BLOCK}.task is missing: add +{BLOCK}.task=<a task the rollout service serves, e.g. shell, "
                "python_math, swe> (a dataset row may override it with extra_info.task)"
            )
        llm_servers = block.get("llm_servers")
        if llm_servers is not None:
            if isinstance(llm_servers, str) or not isinstance(llm_servers, (list, tuple)) or not llm_servers:
                raise ProrlVerlConfigError(
                    f"{BLOCK}.llm_servers={llm_servers!r} must be a non-empty list of URLs, or left out to use "
                    "verl's own vLLM replicas"
                )
            llm_servers = tuple(_url(u, f"{BLOCK}.llm_servers[{i}]") for i, u in enumerate(llm_servers))
        sampling = dict(block.get("sampling") or {})
        for name, owner in _VERL_OWNED_SAMPLING.items():
            if name in sampling:
                raise ProrlVerlConfigError(f"{BLOCK}.sampling.{name}: set {owner} instead (verl's setting is used)")
        try:
            SamplingParams.model_validate(sampling)
        except ValueError as exc:
            raise ProrlVerlConfigError(f"{BLOCK}.sampling is not valid per-turn sampling: {exc}") from exc
        timeout = block.get("timeout_s")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
        ):
            raise ProrlVerlConfigError(f"{BLOCK}.timeout_s={timeout!r} must be a number of seconds")
        if timeout is not None and timeout <= 0:
            raise ProrlVerlConfigError(f"{BLOCK}.timeout_s={timeout!r} must be > 0")
        reward_source = block.get("reward_source", "service")
        if reward_source not in REWARD_SOURCES:
            raise ProrlVerlConfigError(
                f"{BLOCK}.reward_source={reward_source!r}: expected one of {', '.join(REWARD_SOURCES)}"
            )
        config = cls(
            service_url=_url(block["service_url"], f"{BLOCK}.service_url"),
            task=block["task"],
            sandbox_url=_url(block["sandbox_url"], f"{BLOCK}.sandbox_url") if block.get("sandbox_url") else None,
            token=block.get("token"),
            llm_servers=llm_servers,
            sampling=sampling,
            max_turns=_positive_int(block.get("max_turns", 8), f"{BLOCK}.max_turns", allow_none=False),
            max_context_tokens=_positive_int(block.get("max_context_tokens"), f"{BLOCK}.max_context_tokens"),
            timeout_s=float(timeout) if timeout is not None else None,
            reward_source=reward_source,
            staleness=dict(block["staleness"]) if block.get("staleness") is not None else None,
            reward=dict(block["reward"]) if block.get("reward") is not None else None,
        )
        config.plugins()  # the shared plugins validate their own sections now, not mid-training
        return config

    def plugin_sections(self) -> dict[str, Any]:
        sections: dict[str, Any] = {}
        if self.staleness is not None:
            sections["staleness"] = self.staleness
        if self.reward is not None:
            sections["reward"] = self.reward
        return sections

    def plugins(self) -> TrainerPlugins:
        return shared_plugins(self.plugin_sections())

    @property
    def staleness_config(self) -> StalenessConfig:
        return StalenessConfig.from_section(self.staleness)


def shared_plugins(sections: Mapping[str, Any]) -> TrainerPlugins:
    """The shared staleness and reward plugins, as fresh objects: the entry points' module-level singletons
    would be reconfigured by every other user in the same process (the sampler and the reward function
    live in one verl process)."""
    try:
        return TrainerPlugins(dict(sections), objects=[StalenessControl(), RewardShaping()], load_entry_points=False)
    except PluginConfigError as exc:
        raise ProrlVerlConfigError(f"{BLOCK}: {exc}") from exc


def _select(config: DictConfig, key: str) -> Any:
    return OmegaConf.select(config, key, default=None)


def check_verl_config(config: DictConfig) -> ProrlVerlConfig:
    """Validate the `prorl` block and that verl's own keys agree with it: the staleness mode needs the sampler
    line (and, for `importance`, verl's rollout correction; for `linear`, not verl's IS weights, which would
    overwrite ours); `reward_source=verl` needs the reward function line."""
    prorl = ProrlVerlConfig.from_block(_select(config, BLOCK))
    mode = prorl.staleness_config.mode
    sampler_path = _select(config, "trainer.v1.sampler.custom_sampler.path")
    sampler_name = _select(config, "trainer.v1.sampler.custom_sampler.name")
    if mode != "off" and (sampler_path != SAMPLER_PATH or sampler_name != SAMPLER_NAME):
        raise ProrlVerlConfigError(
            f"{BLOCK}.staleness.mode={mode} is applied by the replay-buffer sampler; add "
            f"trainer.v1.sampler.custom_sampler.path={SAMPLER_PATH} "
            f"trainer.v1.sampler.custom_sampler.name={SAMPLER_NAME} "
            f"+trainer.v1.sampler.sampler_kwargs.staleness='${{{BLOCK}.staleness}}'"
        )
    if mode != "off":
        kwargs = _select(config, "trainer.v1.sampler.sampler_kwargs") or {}
        if "staleness" not in kwargs:
            raise ProrlVerlConfigError(
                f"the sampler reads the staleness section from its kwargs; add "
                f"+trainer.v1.sampler.sampler_kwargs.staleness='${{{BLOCK}.staleness}}'"
            )
        if _select(config, "algorithm.filter_groups.enable"):
            raise ProrlVerlConfigError(
                "verl hands a custom sampler no group-filtering settings, so algorithm.filter_groups (DAPO) would "
                f"silently do nothing with the staleness sampler; set algorithm.filter_groups.enable=False or "
                f"+{BLOCK}.staleness.mode=off"
            )
    rollout_is = _select(config, "algorithm.rollout_correction.rollout_is")
    if mode == "linear" and rollout_is is not None:
        raise ProrlVerlConfigError(
            f"{BLOCK}.staleness.mode=linear writes per-sample loss weights into verl's rollout_is_weights, which "
            f"algorithm.rollout_correction.rollout_is={rollout_is} would overwrite; unset it "
            f"(algorithm.rollout_correction.rollout_is=null) or use {BLOCK}.staleness.mode=importance"
        )
    if mode == "importance" and rollout_is != "token":
        raise ProrlVerlConfigError(
            f"{BLOCK}.staleness.mode=importance uses verl's rollout correction for the per-token truncated "
            f"importance weights; add algorithm.rollout_correction.rollout_is=token "
            f"algorithm.rollout_correction.rollout_is_threshold={prorl.staleness_config.importance_cap} "
            "actor_rollout_ref.rollout.calculate_log_probs=True"
        )
    if prorl.reward_source == "verl":
        path = _select(config, "reward.custom_reward_function.path")
        name = _select(config, "reward.custom_reward_function.name")
        if path != REWARD_PATH or name != REWARD_NAME:
            raise ProrlVerlConfigError(
                f"{BLOCK}.reward_source=verl lets verl's reward manager score episodes; add "
                f"reward.custom_reward_function.path={REWARD_PATH} reward.custom_reward_function.name={REWARD_NAME}"
            )
    return prorl


def verl_lines(staleness: bool = True, reward_in_verl: bool = False) -> list[str]:
    """The verl overrides that turn the plugin on, for the README, the example and the tests."""
    lines = [
        f"actor_rollout_ref.model.external_lib={PLUGIN_MODULE}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_LOOP_NAME}",
    ]
    if staleness:
        lines += [
            f"trainer.v1.sampler.custom_sampler.path={SAMPLER_PATH}",
            f"trainer.v1.sampler.custom_sampler.name={SAMPLER_NAME}",
            f"+trainer.v1.sampler.sampler_kwargs.staleness=${{{BLOCK}.staleness}}",
        ]
    if reward_in_verl:
        lines += [
            f"reward.custom_reward_function.path={REWARD_PATH}",
            f"reward.custom_reward_function.name={REWARD_NAME}",
        ]
    return lines
