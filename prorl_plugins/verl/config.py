"""What a verl recipe with the plugin contains, written down once, and the check that derives from it.

A user adds to a working verl GRPO recipe the `prorl` block, at least

    +prorl.service_url=http://rollout-host:8766 +prorl.task=python_math

and the verl lines around it, which `LINES` holds: one row per verl key, with the value it must have, the
recipes that need it (every one, or one staleness mode, or `reward_source=verl`) and what goes wrong without
it. `verl_lines()` prints the lines from that table, and `check_verl_config()` checks a composed verl config
against the same table, failing with a `ProrlVerlConfigError` that names each wrong line and the line to write
instead. The check runs in `python -m prorl_plugins.verl.check` before any GPU is touched, in the staleness
sampler when verl's trainer starts, and at the first rollout of every agent loop worker.

Instead of a running service, the run may start its own rollout stack on verl's Ray cluster:

    +prorl.launch=ray +prorl.task=python_math [+prorl.launch_replicas=2] [+prorl.runtime_resource=prorl_runtime]

(`launch_replicas`: rollout service replicas, default 1; `runtime_resource`: a sandbox runtime on each node with
this custom Ray resource, default every node; `launch_namespace`: the stack's Ray namespace, default one per
training run; `runtime_host_paths`: host directories the runtimes show their image-less sandboxes read-only, as
their `--host-path`, e.g. `[/opt/prorl-agent]` for agent programs). The first agent loop worker starts Redis,
the replicas and the runtimes (`prorl_adapter.launch.ray_stack`), the others attach; the replicas tokenize with
`actor_rollout_ref.model.tokenizer_path` or `.path`, and generate with verl's own vLLM replicas, as with a
service of one's own. `service_url` and `sandbox_url` are then not given.

Staleness is stated once, in `prorl.staleness`: the sampler reads it from the verl config it is built from.
What the rollout service was started with (`--plugin-config`) must not say otherwise: `check_service()`
compares the service's sections (`GET /v1/plugins`) with the block, and its tasks (`GET /v1/tasks`) with
`prorl.task`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import pydantic.dataclasses
from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from prorl_adapter.hooks import PluginConfigError, PluginLoadError, PluginSet
from prorl_adapter.models import LLM_PROTOCOLS, AgentProgram, SamplingParams
from prorl_plugins.staleness import StalenessConfig
from server_kit.errors import ProrlError
from server_kit.openapi import describe_validation

AGENT_LOOP_NAME = "prorl_agent"
PLUGIN_MODULE = "prorl_plugins.verl"
SAMPLER_PATH = "pkg://prorl_plugins.verl.sampler"
SAMPLER_NAME = "StalenessReplayBuffer"
REWARD_PATH = "pkg://prorl_plugins.verl.reward"
REWARD_NAME = "compute_score"
BLOCK = "prorl"
# verl's rollout sampling settings win over the block's: one place per setting.
_VERL_OWNED_SAMPLING = {
    "temperature": "actor_rollout_ref.rollout.temperature",
    "top_p": "actor_rollout_ref.rollout.top_p",
}
_LAUNCH_KEYS = ("launch_replicas", "runtime_resource", "launch_namespace", "runtime_host_paths")


class ProrlVerlConfigError(ProrlError, ValueError):
    """A wrong plugin line; the message names the verl config key and what to write."""


def _http_url(value: str, protocols: tuple[str, ...] = ()) -> str:
    """An http(s) URL, without a trailing slash; `protocols`: the prefixes it may name (`sglang+http://...`)."""
    try:
        parsed = urlparse(value)
        parsed.port  # noqa: B018 - raises ValueError on a port that is not a number, as urlparse on a bad IPv6 host
    except ValueError as exc:
        raise PydanticCustomError("url", f"{value!r} is not a URL: {exc}") from None
    named, plus, scheme = parsed.scheme.rpartition("+")
    if scheme not in ("http", "https") or (plus and named not in protocols) or not parsed.netloc:
        raise PydanticCustomError("url", f"{value!r} is not an http(s) URL; write e.g. http://127.0.0.1:8766")
    return value.rstrip("/")


def _absolute(path: str) -> str:
    """The runtime checks the rest of a host path (that it exists, and is not its own) when it starts."""
    if not path.startswith("/"):
        raise PydanticCustomError("absolute_path", f"{path!r} is not an absolute path, e.g. /opt/prorl-agent")
    return path


def _per_turn_sampling(value: Any) -> dict[str, Any]:
    """The settings given (none: verl's and the service's defaults), valid as `SamplingParams`; verl's rollout
    sampling settings win over the block's: one place per setting."""
    for name, owner in _VERL_OWNED_SAMPLING.items():
        if isinstance(value, Mapping) and name in value:
            raise PydanticCustomError("owned_by_verl", f"{name}: set {owner} instead (verl's setting is used)")
    return SamplingParams.model_validate(value or {}).model_dump(exclude_unset=True)


def _named(value: str) -> str:
    if not value.strip():
        raise PydanticCustomError("name", "must be a name, not blank")
    return value


def _path_list(value: Any) -> Any:
    """None: no paths. One path alone (a string) is a mistake to tell, not a sequence of characters."""
    if value is None:
        return ()
    if isinstance(value, str):
        raise PydanticCustomError("host_paths", "must be a list of absolute paths, e.g. [/opt/prorl-agent]")
    return value


Url = Annotated[StrictStr, AfterValidator(_http_url)]
LlmUrl = Annotated[StrictStr, AfterValidator(partial(_http_url, protocols=LLM_PROTOCOLS))]
Name = Annotated[StrictStr, AfterValidator(_named)]
HostPaths = Annotated[tuple[Annotated[StrictStr, AfterValidator(_absolute)], ...], BeforeValidator(_path_list)]
Launcher = Literal["ray"]  # prorl.launch: who starts the rollout stack for the run (the module docstring)
RewardSource = Literal["service", "verl"]


# A dataclass (pydantic's: it validates), so that a launched block takes its stack's URL with dataclasses.replace.
# An unknown key is a typo; a number given as a string or a boolean a mistake (Hydra gives numbers as numbers).
@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, config=ConfigDict(extra="forbid"))
class ProrlVerlConfig:
    """The validated `prorl` block."""

    service_url: Url | None = None  # None with launch=ray: the launched stack's, once it is up
    task: StrictStr = Field(min_length=1)  # a dataset row may override it with extra_info.task
    sandbox_url: Annotated[Url | None, BeforeValidator(lambda value: value or None)] = None  # empty: none
    token: StrictStr | StrictInt | None = None  # Hydra reads a token of digits as a number
    llm_servers: Annotated[tuple[LlmUrl, ...], Field(min_length=1)] | None = None  # None: verl's own vLLM replicas
    sampling: Annotated[dict[str, Any], BeforeValidator(_per_turn_sampling)] = Field(default_factory=dict)
    max_turns: int = Field(8, gt=0, strict=True)
    max_context_tokens: int | None = Field(None, gt=0, strict=True)  # None: verl's prompt_length + response_length
    timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False, strict=True)
    reward_source: RewardSource = "service"
    staleness: dict[str, Any] | None = None  # validated by the plugins, as the service's section is
    reward: dict[str, Any] | None = None
    agent: AgentProgram | None = None  # an agent program of the user's own runs each episode (docs/gateway.md)
    # launch=ray: the agent loop workers start the rollout stack on verl's own Ray cluster, once per run
    launch: Launcher | None = None
    launch_replicas: int = Field(1, gt=0, strict=True)
    runtime_resource: Name | None = None  # None: a sandbox runtime on every node
    launch_namespace: Name | None = None  # None: prorl-<the Ray job id>, one stack per training run
    runtime_host_paths: HostPaths = ()  # the launched runtimes' --host-path (image-less sandboxes see them)

    @classmethod
    def from_block(cls, block: Any) -> ProrlVerlConfig:
        if block is None:
            raise ProrlVerlConfigError(
                f"the {AGENT_LOOP_NAME!r} agent loop needs a `{BLOCK}` block in the verl config; add at least "
                f"+{BLOCK}.service_url=http://<rollout-host>:<port> +{BLOCK}.task=<task name, e.g. python_math>"
            )
        if isinstance(block, DictConfig):
            block = OmegaConf.to_container(block, resolve=True)
        if isinstance(block, Mapping) and block.get("task") is None:  # what to write, not only that it is missing
            raise ProrlVerlConfigError(
                f"{BLOCK}.task is missing: add +{BLOCK}.task=<task name, e.g. python_math> (a dataset row may name "
                "its own in extra_info.task)"
            )
        try:  # validated under its name, so that each error names the key as written: prorl.max_turns
            config = _BLOCK.validate_python({BLOCK: block})[BLOCK]
        except ValidationError as exc:
            raise ProrlVerlConfigError(describe_validation(exc, _BLOCK_TYPE)) from None
        _check_provider(block)
        config.plugins()  # the shared plugins validate their own sections now, not mid-training
        return config

    def plugin_sections(self) -> dict[str, Any]:
        sections: dict[str, Any] = {}
        if self.staleness is not None:
            sections["staleness"] = self.staleness
        if self.reward is not None:
            sections["reward"] = self.reward
        return sections

    def plugins(self) -> PluginSet:
        return plugin_set(self.plugin_sections())

    @property
    def staleness_config(self) -> StalenessConfig:
        return StalenessConfig.from_section(self.staleness)


_BLOCK_TYPE = dict[str, ProrlVerlConfig]
_BLOCK = TypeAdapter(_BLOCK_TYPE)


def _check_provider(block: Mapping[str, Any]) -> None:
    """Who provides the rollout service: a running one (`service_url`), or a stack the run starts itself
    (`launch=ray`); exactly one of them, and the launch settings only with a launch. A check of the block as
    written, not of the config: a launched block takes its stack's URL (agent_loop.launched_block)."""
    launch = block.get("launch")
    if launch is None and block.get("service_url") is None:
        raise ProrlVerlConfigError(
            f"{BLOCK}.service_url is missing: add +{BLOCK}.service_url=http://<rollout-host>:<port> "
            f"(the rollout service, started with `prorl-rollout`), or +{BLOCK}.launch=ray to start it on verl's "
            "Ray cluster"
        )
    if launch is not None:
        for key in ("service_url", "sandbox_url"):
            if block.get(key) is not None:
                raise ProrlVerlConfigError(
                    f"{BLOCK}.{key} and {BLOCK}.launch={launch} both say where the rollout stack is: drop "
                    f"+{BLOCK}.{key} (the launched stack's is used) or +{BLOCK}.launch"
                )
    else:
        for key in _LAUNCH_KEYS:
            if block.get(key) is not None:
                raise ProrlVerlConfigError(f"{BLOCK}.{key} is a setting of a launched stack: add +{BLOCK}.launch=ray")


def plugin_set(sections: Mapping[str, Any], objects: tuple[object, ...] = ()) -> PluginSet:
    """The installed plugins (the entry points the rollout service loads too), each a fresh instance
    configured with its section of `sections`, plus `objects`: one set per user in a process (the sampler and
    the reward function live in one verl process, each with its own)."""
    try:
        return PluginSet.load(config=dict(sections), objects=objects, entry_points=True)
    except (PluginConfigError, PluginLoadError) as exc:
        raise ProrlVerlConfigError(f"{BLOCK}: {exc}") from exc


def _select(config: DictConfig, key: str) -> Any:
    value = OmegaConf.select(config, key, default=None)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


# -- the verl lines around the block: the one table the check and verl_lines() read ------------------------
UNSET = object()  # a line's value when the recipe must not have the line at all
EXTERNAL_LIB_KEY = "actor_rollout_ref.model.external_lib"

# Which recipes need a line, decided by the two settings of the block that matter: staleness and reward_source.
ALWAYS = "always"
STALENESS_ON = f"{BLOCK}.staleness.mode is not off"
LINEAR = f"{BLOCK}.staleness.mode=linear"
IMPORTANCE = f"{BLOCK}.staleness.mode=importance"
REWARD_IN_VERL = f"{BLOCK}.reward_source=verl"
_WHEN: dict[str, Callable[[StalenessConfig, str], bool]] = {
    ALWAYS: lambda staleness, reward_source: True,
    STALENESS_ON: lambda staleness, reward_source: staleness.mode != "off",
    LINEAR: lambda staleness, reward_source: staleness.mode == "linear",
    IMPORTANCE: lambda staleness, reward_source: staleness.mode == "importance",
    REWARD_IN_VERL: lambda staleness, reward_source: reward_source == "verl",
}


@dataclass(frozen=True)
class VerlLine:
    """One verl key a recipe with the `prorl` block must set (`value`), or must leave alone (`UNSET`)."""

    key: str
    value: Any  # a plain value, a function of the staleness section where it follows from it, or UNSET
    when: str  # a key of _WHEN: which recipes need the line
    why: str  # what goes wrong without it

    def expected(self, staleness: StalenessConfig) -> Any:
        return self.value(staleness) if callable(self.value) else self.value

    def applies(self, staleness: StalenessConfig, reward_source: str) -> bool:
        return _WHEN[self.when](staleness, reward_source)

    def accepts(self, found: Any, expected: Any) -> bool:
        if expected is UNSET:
            return found is None
        if self.key == EXTERNAL_LIB_KEY and isinstance(found, list):  # verl imports each module of a list
            return expected in found
        if isinstance(expected, bool):
            return found is expected or (found is None and expected is False)
        return found == expected

    def text(self, expected: Any) -> str:
        if expected is UNSET:
            return f"drop the line +{self.key}=..."
        return f"{self.key}={_verl_value(expected)}"

    def complaint(self, found: Any, expected: Any) -> str:
        if expected is UNSET:
            return f"{self.key} is set ({self.why}): {self.text(expected)}"
        state = " is not set" if found is None else f"={_verl_value(found)} is wrong"
        return f"{self.key}{state} ({self.why}); write {self.text(expected)}"


def _verl_value(value: Any) -> str:
    if value is None:
        return "null"
    return str(value)


_SAMPLER_WHY = "the staleness modes are applied by the plugin's replay-buffer sampler"
_REWARD_WHY = "with reward_source=verl, verl's reward manager scores the episodes with the plugin's function"

LINES: tuple[VerlLine, ...] = (
    VerlLine(
        EXTERNAL_LIB_KEY,
        PLUGIN_MODULE,
        ALWAYS,
        f"verl imports it in every agent loop worker, and importing it registers the {AGENT_LOOP_NAME} loop",
    ),
    VerlLine(
        "actor_rollout_ref.rollout.agent.default_agent_loop",
        AGENT_LOOP_NAME,
        ALWAYS,
        f"the `{BLOCK}` block configures the {AGENT_LOOP_NAME} loop, and verl runs the loop named here",
    ),
    VerlLine(
        "trainer.v1.sampler.sampler_kwargs.staleness",
        UNSET,
        ALWAYS,
        f"the sampler reads {BLOCK}.staleness from the config itself: staleness is stated once, there",
    ),
    VerlLine("trainer.v1.sampler.custom_sampler.path", SAMPLER_PATH, STALENESS_ON, _SAMPLER_WHY),
    VerlLine("trainer.v1.sampler.custom_sampler.name", SAMPLER_NAME, STALENESS_ON, _SAMPLER_WHY),
    VerlLine(
        "algorithm.filter_groups.enable",
        False,
        STALENESS_ON,
        "verl hands a custom sampler no group-filtering settings, so filter_groups (DAPO) would silently do "
        f"nothing with the staleness sampler; or write +{BLOCK}.staleness.mode=off",
    ),
    VerlLine(
        "algorithm.rollout_correction.rollout_is",
        None,
        LINEAR,
        "linear writes per-sample loss weights into verl's rollout_is_weights, which verl's rollout correction "
        f"would overwrite; or use {BLOCK}.staleness.mode=importance",
    ),
    VerlLine(
        "algorithm.rollout_correction.rollout_is",
        "token",
        IMPORTANCE,
        "importance's per-token truncated ratios are computed by verl's rollout correction",
    ),
    VerlLine(
        "algorithm.rollout_correction.rollout_is_threshold",
        lambda staleness: staleness.importance_cap,
        IMPORTANCE,
        f"verl truncates the ratios at this cap, which must be {BLOCK}.staleness.importance_cap (default 2.0)",
    ),
    VerlLine(
        "actor_rollout_ref.rollout.calculate_log_probs",
        True,
        IMPORTANCE,
        "the ratios need the rollout's logprobs",
    ),
    VerlLine("reward.custom_reward_function.path", REWARD_PATH, REWARD_IN_VERL, _REWARD_WHY),
    VerlLine("reward.custom_reward_function.name", REWARD_NAME, REWARD_IN_VERL, _REWARD_WHY),
)


def verl_lines(staleness: Mapping[str, Any] | None = None, reward_source: str = "service") -> list[str]:
    """The verl lines a recipe with this staleness section and reward source needs (the `prorl` block aside),
    for the docs, the example and the tests. Lines whose value is verl's default are included too."""
    config = StalenessConfig.from_section(staleness)
    lines = []
    for line in LINES:
        expected = line.expected(config)
        if line.applies(config, reward_source) and expected is not UNSET and line.text(expected) not in lines:
            lines.append(line.text(expected))
    return lines


def check_verl_config(config: DictConfig) -> ProrlVerlConfig:
    """Validate the `prorl` block, then every line of `LINES` its settings call for; one error lists every
    wrong line with the line to write."""
    prorl = ProrlVerlConfig.from_block(_select(config, BLOCK))
    staleness = prorl.staleness_config
    wrong = []
    for line in LINES:
        if line.applies(staleness, prorl.reward_source):
            found, expected = _select(config, line.key), line.expected(staleness)
            if not line.accepts(found, expected):
                wrong.append(line.complaint(found, expected))
    if len(wrong) == 1:
        raise ProrlVerlConfigError(wrong[0])
    if wrong:
        raise ProrlVerlConfigError(f"{len(wrong)} verl lines are wrong:\n  " + "\n  ".join(wrong))
    return prorl


# -- what the rollout service says: its tasks and the plugin sections it was started with ------------------
def block_lines(section: str, value: Any) -> list[str]:
    """`+prorl.<section>.<key>=<value>` lines that state `value` (a mapping of settings) in the block."""
    if isinstance(value, Mapping):
        return [line for key, item in value.items() for line in block_lines(f"{section}.{key}", item)]
    return [f"+{BLOCK}.{section}={_verl_value(value)}"]


def check_service(prorl: ProrlVerlConfig, tasks: list[str] | None, sections: Mapping[str, Any] | None) -> None:
    """`prorl.task` must be one of the service's `tasks`; the block's plugin sections must agree with the ones
    the service was started with (`sections`, its `--plugin-config`). None: not asked."""
    if tasks is not None and prorl.task not in tasks:
        close = difflib.get_close_matches(prorl.task, tasks, n=1)
        hint = f"+{BLOCK}.task={close[0]}" if close else f"+{BLOCK}.task=<one of them>"
        raise ProrlVerlConfigError(
            f"{BLOCK}.task={prorl.task!r} is not a task of the rollout service at {prorl.service_url}, which has: "
            f"{', '.join(sorted(tasks)) or 'none'}; write {hint} (or start the service with the task's plugin)"
        )
    if sections is None:
        return
    service_staleness = StalenessConfig.from_section(sections.get("staleness"))
    if service_staleness.mode != "off" and service_staleness != prorl.staleness_config:
        raise ProrlVerlConfigError(
            f"staleness is stated twice, and differently: the recipe has {BLOCK}.staleness="
            f"{_stated(prorl.staleness)}, the rollout service at {prorl.service_url} was started with staleness="
            f"{sections['staleness']} (its --plugin-config). verl applies the recipe's, in its sampler; the "
            "service's does nothing to verl's episodes. Drop the section from the service's --plugin-config, or "
            f"write the same in the recipe: {' '.join(block_lines('staleness', sections['staleness']))}"
        )
    service_reward = sections.get("reward")
    if (prorl.reward is not None or prorl.reward_source == "verl") and (prorl.reward or {}) != (service_reward or {}):
        fix = (
            f"drop {BLOCK}.reward from the recipe (the service's section shapes the reward), or write the service's"
            if prorl.reward_source == "service"
            else "with reward_source=verl, verl's reward function must shape as the service does: write the service's"
        )
        lines = " ".join(block_lines("reward", service_reward or {})) or "(it has none: drop prorl.reward)"
        raise ProrlVerlConfigError(
            f"the reward shaping is stated twice, and differently: the recipe has {BLOCK}.reward="
            f"{_stated(prorl.reward)}, the rollout service at {prorl.service_url} was started with reward="
            f"{_stated(service_reward)} (its --plugin-config), which shapes every episode's reward; {fix}: {lines}"
        )


def _stated(section: Any) -> str:
    return "(not stated)" if section is None else str(section)
