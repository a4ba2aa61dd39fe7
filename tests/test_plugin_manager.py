"""The plugin manager without installing anything: plugins by object, by import path and by entry point (a
stand-in for `importlib.metadata.entry_points`), blocking, load errors that name the plugin, task collection,
and how the core's hooks combine their results (firstresult or all)."""

from __future__ import annotations

import re
import sys
import textwrap
from importlib.metadata import EntryPoint
from typing import Any

import pytest

from prorl_adapter.hooks import manager as plugins
from prorl_adapter.hooks.manager import PluginLoadError, collect_tasks, import_object, make_plugin_manager
from prorl_adapter.hooks.specs import PluginConfigError, hookimpl
from prorl_adapter.models import StageTimings, Trajectory
from prorl_adapter.service.pipeline import RolloutPipeline
from prorl_adapter.tasks import Environment, EpisodeState, TaskHandler


# -- small plugins ---------------------------------------------------------------------------------------
class EchoTask(TaskHandler):
    name = "echo"

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return "Say it back."

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return str(instance.get("text", ""))

    async def evaluate(self, env: Environment, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        return {"outcome": float(state.answer == instance.get("text"))}


class Tasks:
    def __init__(self, *handlers: Any) -> None:
        self.handlers = list(handlers)

    @hookimpl
    def prorl_register_tasks(self) -> list[Any]:
        return self.handlers


class Combine:
    """Answers `prorl_combine_reward` and `prorl_backend_policy_version` with fixed values, and records calls."""

    def __init__(self, reward: float | None = None, version: int | None = None) -> None:
        self.reward, self.version, self.calls = reward, version, 0

    @hookimpl
    def prorl_combine_reward(self, trajectory: Trajectory, components: dict[str, float]) -> float | None:
        self.calls += 1
        return self.reward

    @hookimpl
    def prorl_backend_policy_version(self) -> int | None:
        self.calls += 1
        return self.version


class Recorder:
    """Records what `prorl_configure` and `prorl_policy_version_changed` receive."""

    def __init__(self) -> None:
        self.configs: list[dict[str, Any]] = []
        self.versions: list[int] = []

    @hookimpl
    def prorl_configure(self, config: dict[str, Any]) -> None:
        self.configs.append(config)

    @hookimpl
    def prorl_policy_version_changed(self, version: int) -> None:
        self.versions.append(version)


def manager(*objects: object) -> Any:
    return make_plugin_manager(objects=objects, load_entry_points=False)


def trajectory(**fields: Any) -> Trajectory:
    values: dict[str, Any] = {
        "job_id": "job-1",
        "task": "echo",
        "prompt_ids": [1],
        "response_ids": [2],
        "response_mask": [1],
        "response_logprobs": [0.0],
        "turns": [],
        "num_turns": 0,
        "finish_reason": "finish",
        "reward_components": {"outcome": 1.0},
        "policy_version_min": 0,
        "policy_version_max": 0,
        "timings": StageTimings(),
    }
    return Trajectory(**{**values, **fields})


# A plugin module as a third party writes it: hook functions at module level, or on an object `plugin`.
PLUGIN_MODULE = """
from prorl_adapter.hooks.specs import hookimpl
from prorl_adapter.tasks import TaskHandler


class Task(TaskHandler):
    name = {task!r}

    def system_prompt(self, instance):
        return ""

    def user_prompt(self, instance):
        return ""

    async def evaluate(self, env, instance, state):
        return {{"outcome": 1.0}}


@hookimpl
def prorl_register_tasks():
    return [Task()]


class Plugin:
    @hookimpl
    def prorl_register_tasks(self):
        return [Task()]


plugin = Plugin()
"""


@pytest.fixture
def write_module(tmp_path, monkeypatch):
    """Writes a throwaway module into a directory on sys.path; forgets it afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Stands in for the installed `prorl_adapter` entry points: `fake_entry_points(name="module:attr", ...)`."""

    def install(**points: str) -> None:
        found = [EntryPoint(name, value, plugins.ENTRY_POINT_GROUP) for name, value in points.items()]
        monkeypatch.setattr(plugins, "entry_points", lambda group: found if group == plugins.ENTRY_POINT_GROUP else [])

    return install


# -- loading ---------------------------------------------------------------------------------------------
def test_a_plugin_object_is_registered_and_its_tasks_collected():
    plugin = Tasks(EchoTask())
    pm = manager(plugin)
    assert pm.is_registered(plugin)
    tasks = collect_tasks(pm)
    assert list(tasks) == ["echo"] and tasks["echo"] is plugin.handlers[0]


@pytest.mark.parametrize("form", ["{module}", "{module}:plugin", "pkg://{module}", "pkg://{module}:plugin"])
def test_a_plugin_by_import_path_is_registered_under_that_path(write_module, form):
    module = write_module("third_party_tasks", PLUGIN_MODULE.format(task="third"))
    path = form.format(module=module)
    pm = make_plugin_manager([path], load_entry_points=False)
    registered = pm.get_plugin(path)
    expected = sys.modules[module]
    assert registered is (expected.plugin if path.endswith(":plugin") else expected)
    assert list(collect_tasks(pm)) == ["third"]


def test_an_entry_point_is_registered_under_its_name(write_module, fake_entry_points):
    module = write_module("installed_tasks", PLUGIN_MODULE.format(task="installed"))
    fake_entry_points(installed=f"{module}:plugin")
    pm = make_plugin_manager()
    assert pm.get_plugin("installed") is sys.modules[module].plugin
    assert list(collect_tasks(pm)) == ["installed"]


def test_the_built_in_tasks_come_from_the_installed_entry_point():
    assert {"shell", "python_math", "swe"} <= set(collect_tasks(make_plugin_manager()))


# -- blocking --------------------------------------------------------------------------------------------
def test_a_blocked_entry_point_is_not_even_imported(write_module, fake_entry_points):
    module = write_module("broken_on_import", "raise RuntimeError('this plugin is broken')\n")
    fake_entry_points(broken=module)
    pm = make_plugin_manager(blocked=["broken"])  # blocking is how to start despite a broken plugin
    assert pm.get_plugin("broken") is None and module not in sys.modules


def test_blocking_the_built_in_tasks_by_their_entry_point_name():
    tasks = collect_tasks(make_plugin_manager(blocked=["builtin_tasks"]))
    assert not {"shell", "python_math", "swe"} & set(tasks)


def test_a_blocked_import_path_is_not_imported(write_module):
    module = write_module("blocked_path", "raise RuntimeError('must not be imported')\n")
    pm = make_plugin_manager([module], blocked=[module], load_entry_points=False)
    assert pm.get_plugin(module) is None and module not in sys.modules


# -- load errors: reported with the plugin's name, never swallowed ----------------------------------------
def test_an_entry_point_that_fails_to_import_is_an_error_naming_it(write_module, fake_entry_points):
    module = write_module("broken_plugin", "raise RuntimeError('this plugin is broken')\n")
    fake_entry_points(broken=f"{module}:plugin")
    with pytest.raises(PluginLoadError) as error:
        make_plugin_manager()
    assert str(error.value) == (
        "plugin 'broken' (broken_plugin:plugin) failed to load: RuntimeError: this plugin is broken"
    )


def test_an_import_path_whose_dependency_is_missing_is_an_error_naming_it(write_module):
    module = write_module("needs_a_dependency", "import prorl_no_such_dependency\n")
    with pytest.raises(PluginLoadError) as error:
        make_plugin_manager([f"{module}:plugin"], load_entry_points=False)
    assert str(error.value) == (
        "cannot load plugin 'needs_a_dependency:plugin': "
        "ModuleNotFoundError: No module named 'prorl_no_such_dependency'"
    )


def test_an_import_path_that_raises_on_import_is_an_error_naming_it(write_module):
    module = write_module("raises_on_import", "raise RuntimeError('this plugin is broken')\n")
    with pytest.raises(PluginLoadError, match=r"raises_on_import.*RuntimeError: this plugin is broken"):
        make_plugin_manager([module], load_entry_points=False)


def test_an_import_path_to_a_missing_attribute_or_module_is_an_error_naming_it(write_module):
    module = write_module("has_no_plugin", "x = 1\n")
    with pytest.raises(PluginLoadError, match=r"cannot load plugin 'has_no_plugin:plugin': AttributeError: .*'plugin'"):
        import_object(f"{module}:plugin")
    with pytest.raises(PluginLoadError, match=r"cannot load plugin 'prorl_no_such_module': ModuleNotFoundError"):
        make_plugin_manager(["prorl_no_such_module"], load_entry_points=False)


def test_a_misspelled_hook_is_a_load_error():
    class Typo:
        @hookimpl
        def prorl_reward_component(self, trajectory: Trajectory) -> dict[str, float]:  # no such hook
            return {"bonus": 1.0}

    with pytest.raises(Exception, match="prorl_reward_component"):
        manager(Typo())


# -- tasks -----------------------------------------------------------------------------------------------
def test_two_tasks_with_one_name_is_an_error_naming_both_plugins(write_module):
    first = write_module("echo_tasks_a", PLUGIN_MODULE.format(task="echo"))
    second = write_module("echo_tasks_b", PLUGIN_MODULE.format(task="echo"))
    pm = make_plugin_manager([first, f"{second}:plugin"], load_entry_points=False)
    with pytest.raises(PluginLoadError) as error:
        collect_tasks(pm)
    assert str(error.value) == "task 'echo' is registered twice: by 'echo_tasks_a' and 'echo_tasks_b:plugin'"


def test_a_task_that_clashes_with_a_built_in_one_names_the_entry_point(write_module):
    module = write_module("my_shell", PLUGIN_MODULE.format(task="shell"))
    with pytest.raises(PluginLoadError, match=r"task 'shell' is registered twice: by 'builtin_tasks' and 'my_shell'"):
        collect_tasks(make_plugin_manager([module]))


@pytest.mark.parametrize("registered", [EchoTask, "echo", None], ids=["the class", "a name", "None"])
def test_registering_something_other_than_a_task_handler_is_an_error_naming_the_plugin(write_module, registered):
    module = write_module(
        "wrong_tasks",
        """
        from prorl_adapter.hooks.specs import hookimpl

        REGISTERED = []

        @hookimpl
        def prorl_register_tasks():
            return REGISTERED
        """,
    )
    pm = make_plugin_manager([module], load_entry_points=False)
    sys.modules[module].REGISTERED.append(registered)
    with pytest.raises(
        PluginLoadError, match=re.escape(f"plugin 'wrong_tasks' registered {registered!r}, not a TaskHandler")
    ):
        collect_tasks(pm)


# -- how results combine ---------------------------------------------------------------------------------
def test_combine_reward_the_first_non_none_result_wins_and_the_rest_are_not_asked():
    # pluggy asks the plugin registered last first (entry points, then --plugin paths, then objects).
    early, abstains = Combine(reward=1.0), Combine(reward=None)
    pm = manager(early, abstains)
    assert pm.hook.prorl_combine_reward(trajectory=trajectory(), components={"outcome": 1.0}) == 1.0
    assert abstains.calls == 1 and early.calls == 1

    late = Combine(reward=3.0)
    pm.register(late)
    assert pm.hook.prorl_combine_reward(trajectory=trajectory(), components={"outcome": 1.0}) == 3.0
    assert early.calls == 1  # not asked once an answer was found


def test_combine_reward_with_no_opinion_is_none():
    pm = manager(Combine(reward=None), Tasks())
    assert pm.hook.prorl_combine_reward(trajectory=trajectory(), components={"outcome": 1.0}) is None


def test_reward_components_are_all_collected_and_an_implementation_takes_only_what_it_needs():
    class Bonus:
        @hookimpl
        def prorl_reward_components(self, trajectory: Trajectory) -> dict[str, float]:
            return {"bonus": 0.5 if trajectory.finish_reason == "finish" else 0.0}

    class Abstains:
        @hookimpl
        def prorl_reward_components(self, trajectory: Trajectory, instance: dict[str, Any]) -> None:
            return None

    class Penalty:
        @hookimpl
        def prorl_reward_components(self, instance: dict[str, Any]) -> dict[str, float]:
            return {"penalty": -float(instance["cost"])}

    pm = manager(Bonus(), Abstains(), Penalty())
    results = pm.hook.prorl_reward_components(trajectory=trajectory(), instance={"cost": 2})
    assert results == [{"penalty": -2.0}, {"bonus": 0.5}]  # pluggy drops None results; last registered first


def test_the_backend_policy_version_wins_over_the_api_version_and_a_new_version_is_announced():
    recorder = Recorder()
    pipeline = RolloutPipeline(manager(recorder), {}, sandboxes=None, llm=None, chat=None)
    pipeline.policy_version = 3  # as PUT /v1/policy-version does
    assert pipeline.policy_version == 3 and recorder.versions == [3]

    backend, abstains = Combine(version=7), Combine(version=None)
    pipeline = RolloutPipeline(manager(backend, abstains), {}, sandboxes=None, llm=None, chat=None)
    pipeline.policy_version = 3
    assert pipeline.policy_version == 7  # the first non-None answer (the backend's) wins


def test_configure_reaches_every_plugin_with_the_whole_configuration():
    recorders = [Recorder(), Recorder(), Recorder()]
    pm = manager(*recorders)
    config = {"staleness": {"mode": "off"}, "mine": {"key": 1}}
    pm.hook.prorl_configure(config=config)
    assert [r.configs for r in recorders] == [[config]] * 3


def test_a_configuration_error_is_raised_to_the_caller():
    class Strict:
        @hookimpl
        def prorl_configure(self, config: dict[str, Any]) -> None:
            if "mine" not in config:
                raise PluginConfigError("strict: mine is required")

    pm = manager(Recorder(), Strict())
    with pytest.raises(PluginConfigError, match="strict: mine is required"):
        pm.hook.prorl_configure(config={})
