"""Loading plugins without installing anything: by object, by import path and by entry point (a stand-in for
`importlib.metadata.entry_points`), classes created once per plugin set with their configuration section,
blocking, load and configuration errors that name the plugin, task collection, how `PluginSet` calls the
hooks and combines their answers (firstresult, all results, observers one at a time), and the callers of the
version and LLM-request hooks (the pipeline, the trainer's driver, the LLM pool)."""

from __future__ import annotations

import logging
import re
import sys
import textwrap
from importlib.metadata import EntryPoint
from typing import Any

import pluggy
import pytest

from prorl_adapter.hooks import PluginConfigError, PluginLoadError, PluginSet, hookimpl
from prorl_adapter.hooks import manager as plugins
from prorl_adapter.hooks.manager import collect_tasks, import_object, make_plugin_manager
from prorl_adapter.hooks.plugin_set import RewardComponentConflict
from prorl_adapter.models import AdmissionState, SamplingParams, StageTimings, Trajectory
from prorl_adapter.service.cli import main
from prorl_adapter.service.llm import LLMPool, Pin
from prorl_adapter.service.pipeline import RolloutPipeline
from prorl_adapter.service.storage.coordination import MemoryCoordination
from prorl_adapter.tasks import Environment, EpisodeState, TaskHandler
from prorl_adapter.trainer.driver import RolloutDriver
from tests.fakes import Fail, ScriptedLLM, on_virtual_time

HERE = __name__  # import paths to the plugins below: f"{HERE}:Bonus"


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
    """Answers `prorl_combine_reward` with a fixed value, and counts the calls."""

    def __init__(self, reward: float | None = None) -> None:
        self.reward, self.calls = reward, 0

    @hookimpl
    def prorl_combine_reward(self, trajectory: Trajectory, components: dict[str, float]) -> float | None:
        self.calls += 1
        return self.reward


class VersionBackend:
    """A backend's `prorl_backend_policy_version` with a fixed answer; records the batches it was asked about
    (a plugin set holds one backend: test_backend_seam.py)."""

    def __init__(self, version: int | None) -> None:
        self.version = version
        self.batches: list[Any] = []

    @hookimpl
    def prorl_backend_policy_version(self, batch: Any) -> int | None:
        self.batches.append(batch)
        return self.version


class Recorder:
    """Records what the observers `prorl_policy_version_changed` and `prorl_stage_event` receive; raises first
    when told to."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.versions: list[int] = []
        self.events: list[tuple[str, str, str]] = []

    @hookimpl
    def prorl_policy_version_changed(self, version: int) -> None:
        if self.fail:
            raise RuntimeError("observer bug")
        self.versions.append(version)

    @hookimpl
    def prorl_stage_event(self, job_id: str, stage: str, event: str) -> None:
        if self.fail:
            raise RuntimeError("observer bug")
        self.events.append((job_id, stage, event))


class Bonus:
    """A class plugin with a configuration section, as a third party writes one: the constructor gets the
    `bonus` section (None without one) and validates it."""

    config_section = "bonus"

    def __init__(self, section: dict[str, Any] | None) -> None:
        self.section = section
        amount = (section or {}).get("amount", 0.1)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise PluginConfigError(f"bonus: bonus.amount must be a number, got {amount!r}")
        self.amount = float(amount)

    @hookimpl
    def prorl_reward_components(self) -> dict[str, float]:
        return {"bonus": self.amount}


class NeedsAGPU:
    def __init__(self) -> None:
        raise RuntimeError("no GPU here")


class Sized:
    """A class plugin without a section: created with no arguments."""

    created = 0

    def __init__(self) -> None:
        Sized.created += 1

    @hookimpl
    def prorl_admit_episode(self, state: AdmissionState) -> bool:
        return state.running < 2


def plugin_set(*objects: object, config: dict[str, Any] | None = None, paths: tuple[str, ...] = ()) -> PluginSet:
    """The given plugins only (no entry points)."""
    return PluginSet.load(config, paths, objects, entry_points=False)


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


# A plugin module as a third party writes it: hook functions at module level, a class, or an object `plugin`.
PLUGIN_MODULE = """
from prorl_adapter.hooks import hookimpl
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
    loaded = plugin_set(plugin)
    assert loaded.manager.is_registered(plugin)
    tasks = loaded.tasks()
    assert list(tasks) == ["echo"] and tasks["echo"] is plugin.handlers[0]


@pytest.mark.parametrize(
    "form", ["{module}", "{module}:plugin", "pkg://{module}", "pkg://{module}:plugin", "{module}:Plugin"]
)
def test_a_plugin_by_import_path_is_registered_under_that_path(write_module, form):
    module = write_module("third_party_tasks", PLUGIN_MODULE.format(task="third"))
    path = form.format(module=module)
    pm = make_plugin_manager(import_paths=[path], load_entry_points=False)
    registered = pm.get_plugin(path)
    loaded = sys.modules[module]
    if path.endswith(":Plugin"):  # a class: created, and its instance registered
        assert type(registered) is loaded.Plugin and registered is not loaded.plugin
    else:
        assert registered is (loaded.plugin if path.endswith(":plugin") else loaded)
    assert list(collect_tasks(pm)) == ["third"]


@pytest.mark.parametrize("attribute", ["plugin", "Plugin"], ids=["an object", "a class"])
def test_an_entry_point_is_registered_under_its_name(write_module, fake_entry_points, attribute):
    module = write_module("installed_tasks", PLUGIN_MODULE.format(task="installed"))
    fake_entry_points(installed=f"{module}:{attribute}")
    pm = make_plugin_manager()
    loaded = sys.modules[module]
    if attribute == "plugin":
        assert pm.get_plugin("installed") is loaded.plugin
    else:
        assert type(pm.get_plugin("installed")) is loaded.Plugin
    assert list(collect_tasks(pm)) == ["installed"]


def test_the_built_in_plugins_come_from_the_installed_entry_points():
    loaded = PluginSet.load()
    assert {"shell", "python_math", "swe"} <= set(loaded.tasks())
    described = {plugin["name"]: plugin for plugin in loaded.describe()}
    assert described["staleness"]["plugin"] == "StalenessControl"  # the entry points name classes
    assert described["reward_shaping"]["plugin"] == "RewardShaping"


# -- classes and their configuration sections -------------------------------------------------------------
def test_a_class_plugin_is_created_with_its_section():
    loaded = plugin_set(config={"bonus": {"amount": 0.5}}, paths=(f"{HERE}:Bonus",))
    plugin = loaded.manager.get_plugin(f"{HERE}:Bonus")
    assert type(plugin) is Bonus and plugin.section == {"amount": 0.5}
    assert loaded.shaped_reward(trajectory(), {}, {"outcome": 1.0}) == ({"outcome": 1.0, "bonus": 0.5}, 1.5)


def test_a_class_plugin_without_its_section_gets_none():
    plugin = plugin_set(paths=(f"{HERE}:Bonus",)).manager.get_plugin(f"{HERE}:Bonus")
    assert plugin.section is None and plugin.amount == 0.1


def test_a_class_without_a_section_is_created_with_no_arguments_once_per_plugin_set():
    before = Sized.created
    loaded = plugin_set(paths=(f"{HERE}:Sized",))
    assert type(loaded.manager.get_plugin(f"{HERE}:Sized")) is Sized and Sized.created == before + 1
    assert loaded.admits(AdmissionState(0, {0: 1}, {})) and not loaded.admits(AdmissionState(0, {0: 2}, {}))


def test_two_plugin_sets_in_one_process_hold_two_configurations(fake_entry_points):
    fake_entry_points(bonus=f"{HERE}:Bonus")
    small = PluginSet.load({"bonus": {"amount": 0.25}})
    large = PluginSet.load({"bonus": {"amount": 2}})
    default = PluginSet.load()
    assert small.manager.get_plugin("bonus") is not large.manager.get_plugin("bonus")
    shaped = [s.shaped_reward(trajectory(), {}, {"outcome": 1.0})[0]["bonus"] for s in (small, large, default)]
    assert shaped == [0.25, 2.0, 0.1]  # each set keeps its own, whichever was loaded last


def test_a_section_that_no_plugin_reads_is_an_error_naming_it(fake_entry_points):
    with pytest.raises(PluginConfigError) as error:
        plugin_set(config={"bonus": {}, "bonsu": {"amount": 1}}, paths=(f"{HERE}:Bonus",))
    assert str(error.value) == "plugin configuration has unknown section(s) 'bonsu'; the loaded plugins read: bonus"

    with pytest.raises(PluginConfigError, match=r"unknown section\(s\) 'bonus'; the loaded plugins read: none$"):
        plugin_set(config={"bonus": {}})

    fake_entry_points(bonus=f"{HERE}:Bonus")  # a blocked plugin reads nothing: its section is an error too
    with pytest.raises(PluginConfigError, match=r"unknown section\(s\) 'bonus'"):
        PluginSet.load({"bonus": {"amount": 1}}, blocked=["bonus"])


def test_a_constructor_raising_plugin_config_error_surfaces_at_load(fake_entry_points):
    message = "bonus: bonus.amount must be a number, got 'lots'"
    with pytest.raises(PluginConfigError, match=f"^{re.escape(message)}$"):
        plugin_set(config={"bonus": {"amount": "lots"}}, paths=(f"{HERE}:Bonus",))
    fake_entry_points(bonus=f"{HERE}:Bonus")
    with pytest.raises(PluginConfigError, match=f"^{re.escape(message)}$"):
        PluginSet.load({"bonus": {"amount": "lots"}})


def test_a_constructor_raising_anything_else_is_a_load_error_naming_the_plugin(fake_entry_points):
    with pytest.raises(PluginLoadError) as error:
        plugin_set(paths=(f"{HERE}:NeedsAGPU",))
    assert str(error.value) == f"plugin '{HERE}:NeedsAGPU' could not be created: RuntimeError: no GPU here"
    fake_entry_points(gpu=f"{HERE}:NeedsAGPU")
    with pytest.raises(PluginLoadError, match=r"^plugin 'gpu' could not be created: RuntimeError: no GPU here$"):
        PluginSet.load()


# -- blocking --------------------------------------------------------------------------------------------
def test_a_blocked_entry_point_is_not_even_imported(write_module, fake_entry_points):
    module = write_module("broken_on_import", "raise RuntimeError('this plugin is broken')\n")
    fake_entry_points(broken=module)
    pm = make_plugin_manager(blocked=["broken"])  # blocking is how to start despite a broken plugin
    assert pm.get_plugin("broken") is None and module not in sys.modules


def test_blocking_the_built_in_tasks_by_their_entry_point_name():
    tasks = PluginSet.load(blocked=["builtin_tasks"]).tasks()
    assert not {"shell", "python_math", "swe"} & set(tasks)


def test_a_blocked_import_path_is_not_imported(write_module):
    module = write_module("blocked_path", "raise RuntimeError('must not be imported')\n")
    pm = make_plugin_manager(import_paths=[module], blocked=[module], load_entry_points=False)
    assert pm.get_plugin(module) is None and module not in sys.modules


def test_describe_lists_each_plugin_its_hooks_and_the_blocked_ones():
    loaded = PluginSet.load(import_paths=[f"{HERE}:Bonus"], blocked=["staleness"])
    described = {plugin["name"]: plugin for plugin in loaded.describe()}
    assert described["builtin_tasks"] == {
        "name": "builtin_tasks",
        "plugin": "prorl_plugins.tasks",  # a module: its name
        "hooks": ["prorl_register_tasks"],
    }
    assert described["reward_shaping"]["hooks"] == ["prorl_combine_reward", "prorl_reward_components"]
    assert described[f"{HERE}:Bonus"] == {
        "name": f"{HERE}:Bonus",
        "plugin": "Bonus",
        "hooks": ["prorl_reward_components"],
    }
    assert described["staleness"] == {"name": "staleness", "plugin": "blocked", "hooks": []}


# -- load errors: reported with the plugin's name, never swallowed ----------------------------------------
def test_an_entry_point_that_fails_to_import_is_an_error_naming_it(write_module, fake_entry_points):
    module = write_module("broken_plugin", "raise RuntimeError('this plugin is broken')\n")
    fake_entry_points(broken=f"{module}:Plugin")
    with pytest.raises(PluginLoadError) as error:
        make_plugin_manager()
    assert str(error.value) == (
        "plugin 'broken' (broken_plugin:Plugin) failed to load: RuntimeError: this plugin is broken"
    )


def test_an_import_path_whose_dependency_is_missing_is_an_error_naming_it(write_module):
    module = write_module("needs_a_dependency", "import prorl_no_such_dependency\n")
    with pytest.raises(PluginLoadError) as error:
        make_plugin_manager(import_paths=[f"{module}:Plugin"], load_entry_points=False)
    assert str(error.value) == (
        "cannot load plugin 'needs_a_dependency:Plugin': "
        "ModuleNotFoundError: No module named 'prorl_no_such_dependency'"
    )


def test_an_import_path_that_raises_on_import_is_an_error_naming_it(write_module):
    module = write_module("raises_on_import", "raise RuntimeError('this plugin is broken')\n")
    with pytest.raises(PluginLoadError, match=r"raises_on_import.*RuntimeError: this plugin is broken"):
        make_plugin_manager(import_paths=[module], load_entry_points=False)


def test_an_import_path_to_a_missing_attribute_or_module_is_an_error_naming_it(write_module):
    module = write_module("has_no_plugin", "x = 1\n")
    with pytest.raises(PluginLoadError, match=r"cannot load plugin 'has_no_plugin:Plugin': AttributeError: .*'Plugin'"):
        import_object(f"{module}:Plugin")
    with pytest.raises(PluginLoadError, match=r"cannot load plugin 'prorl_no_such_module': ModuleNotFoundError"):
        make_plugin_manager(import_paths=["prorl_no_such_module"], load_entry_points=False)


def test_a_misspelled_hook_is_a_load_error():
    class Typo:
        @hookimpl
        def prorl_reward_component(self, trajectory: Trajectory) -> dict[str, float]:  # no such hook
            return {"bonus": 1.0}

    with pytest.raises(PluginLoadError, match=r"hook that does not exist.*prorl_reward_component"):
        plugin_set(Typo())


def test_an_implementation_asking_for_an_argument_its_hook_lacks_is_a_load_error():
    class Greedy:
        @hookimpl
        def prorl_stage_event(self, job_id: str, reward: float) -> None:  # the hook has no `reward`
            pass

    with pytest.raises(pluggy.PluginValidationError, match="reward"):
        plugin_set(Greedy())


# -- tasks -----------------------------------------------------------------------------------------------
def test_two_tasks_with_one_name_is_an_error_naming_both_plugins(write_module):
    first = write_module("echo_tasks_a", PLUGIN_MODULE.format(task="echo"))
    second = write_module("echo_tasks_b", PLUGIN_MODULE.format(task="echo"))
    loaded = plugin_set(paths=(first, f"{second}:Plugin"))
    with pytest.raises(PluginLoadError) as error:
        loaded.tasks()
    assert str(error.value) == "task 'echo' is registered twice: by 'echo_tasks_a' and 'echo_tasks_b:Plugin'"


def test_a_task_that_clashes_with_a_built_in_one_names_the_entry_point(write_module):
    module = write_module("my_shell", PLUGIN_MODULE.format(task="shell"))
    with pytest.raises(PluginLoadError, match=r"task 'shell' is registered twice: by 'builtin_tasks' and 'my_shell'"):
        PluginSet.load(import_paths=[module]).tasks()


@pytest.mark.parametrize("registered", [EchoTask, "echo", None], ids=["the class", "a name", "None"])
def test_registering_something_other_than_a_task_handler_is_an_error_naming_the_plugin(write_module, registered):
    module = write_module(
        "wrong_tasks",
        """
        from prorl_adapter.hooks import hookimpl

        REGISTERED = []

        @hookimpl
        def prorl_register_tasks():
            return REGISTERED
        """,
    )
    loaded = plugin_set(paths=(module,))
    sys.modules[module].REGISTERED.append(registered)
    with pytest.raises(
        PluginLoadError, match=re.escape(f"plugin 'wrong_tasks' registered {registered!r}, not a TaskHandler")
    ):
        loaded.tasks()


# -- how PluginSet combines the answers --------------------------------------------------------------------
def test_combine_reward_the_first_non_none_result_wins_and_the_rest_are_not_asked():
    # pluggy asks the plugin registered last first (entry points, then --plugin paths, then objects).
    early, abstains = Combine(reward=1.0), Combine(reward=None)
    loaded = plugin_set(early, abstains)
    assert loaded.shaped_reward(trajectory(), {}, {"outcome": 0.5}) == ({"outcome": 0.5}, 1.0)
    assert abstains.calls == 1 and early.calls == 1

    late = Combine(reward=3.0)
    loaded.register(late)
    assert loaded.shaped_reward(trajectory(), {}, {"outcome": 0.5})[1] == 3.0
    assert early.calls == 1  # not asked once an answer was found


def test_with_no_combining_plugin_the_reward_is_the_sum_of_the_components():
    loaded = plugin_set(Combine(reward=None), Tasks())
    assert loaded.hooks.prorl_combine_reward(trajectory=trajectory(), components={"outcome": 1.0}) is None
    assert loaded.shaped_reward(trajectory(), {}, {"outcome": 1.0, "extra": -0.25}) == (
        {"outcome": 1.0, "extra": -0.25},
        0.75,
    )


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

    loaded = plugin_set(Bonus(), Abstains(), Penalty())
    results = loaded.hooks.prorl_reward_components(trajectory=trajectory(), instance={"cost": 2})
    assert results == [{"penalty": -2.0}, {"bonus": 0.5}]  # pluggy drops None results; last registered first
    components, reward = loaded.shaped_reward(trajectory(), {"cost": 2}, {"outcome": 1.0})
    assert components == {"outcome": 1.0, "penalty": -2.0, "bonus": 0.5} and reward == -0.5


def test_a_reward_component_given_twice_is_an_error():
    class Gives:
        def __init__(self, name: str) -> None:
            self.name = name

        @hookimpl
        def prorl_reward_components(self) -> dict[str, float]:
            return {self.name: -1.0}

    with pytest.raises(RewardComponentConflict, match="reward component 'outcome' is given twice"):
        plugin_set(Gives("outcome")).shaped_reward(trajectory(), {}, {"outcome": 1.0})
    with pytest.raises(RewardComponentConflict, match="reward component 'safety' is given twice"):
        plugin_set(Gives("safety"), Gives("safety")).shaped_reward(trajectory(), {}, {"outcome": 1.0})
    # A trainer recomputing the shaping passes the recorded components, which hold the plugins' own already.
    recorded = {"outcome": 1.0, "safety": -3.0}
    assert plugin_set(Gives("safety")).shaped_reward(trajectory(), {}, recorded, replace_recorded=True) == (
        {"outcome": 1.0, "safety": -1.0},
        0.0,
    )


def test_any_false_holds_an_episode_back_and_none_or_true_admit():
    class Says:
        def __init__(self, verdict: bool | None) -> None:
            self.verdict = verdict

        @hookimpl
        def prorl_admit_episode(self) -> bool | None:
            return self.verdict

    state = AdmissionState(3, {3: 1}, {2: 1})
    assert plugin_set().admits(state)
    assert plugin_set(Says(None), Says(True)).admits(state)
    assert not plugin_set(Says(True), Says(False), Says(None)).admits(state)


def test_the_largest_expiry_wins_and_none_has_no_opinion():
    class Expires:
        def __init__(self, behind: int | None) -> None:
            self.behind = behind

        @hookimpl
        def prorl_expired_before(self, current_version: int) -> int | None:
            return None if self.behind is None else current_version - self.behind

    assert plugin_set().expired_before(10) is None
    assert plugin_set(Expires(None)).expired_before(10) is None
    assert plugin_set(Expires(4), Expires(None), Expires(2)).expired_before(10) == 8


def test_notify_calls_every_observer_and_a_raising_one_is_logged_and_skipped(caplog):
    before, failing, after = Recorder(), Recorder(fail=True), Recorder()
    loaded = plugin_set(before, failing, after)
    with caplog.at_level(logging.ERROR, logger="prorl_adapter.hooks.plugin_set"):
        loaded.notify("prorl_policy_version_changed", version=4)
        loaded.notify("prorl_stage_event", job_id="j", task="t", stage="run", event="end", seconds=1.0, error=None)
    assert before.versions == after.versions == [4]  # each observer takes only the arguments it names
    assert before.events == after.events == [("j", "run", "end")]
    failures = [r for r in caplog.records if "failed in" in r.getMessage()]
    assert [r.getMessage().split(" failed in ")[1] for r in failures] == [
        "prorl_policy_version_changed",
        "prorl_stage_event",
    ]
    assert all(r.exc_info and "observer bug" in str(r.exc_info[1]) for r in failures)


async def test_a_new_api_version_is_announced_to_the_observers():
    recorder, failing = Recorder(), Recorder(fail=True)
    coordination = MemoryCoordination("r")  # the version's owner; the pipeline reads it
    plugins = plugin_set(failing, recorder)
    pipeline = RolloutPipeline(plugins, {}, sandboxes=None, llm=None, chat=None, coordination=coordination)
    await coordination.set_policy_version(3, raise_only=False)  # as PUT /v1/policy-version does
    assert pipeline.policy_version == 3 and recorder.versions == [3]  # a failing observer changes nothing


class VersionClient:
    """Stands in for `RolloutClient` where the driver publishes a version."""

    def __init__(self) -> None:
        self.published: list[int] = []

    async def set_policy_version(self, version: int, raise_only: bool = False) -> int:
        self.published.append(version)
        return version


async def test_the_backends_version_is_published_by_the_driver_and_announced():
    # The service tags turns with the version set through its API; a backend that knows the trainer's version
    # (its `prorl_backend_policy_version` is not None) has the driver publish it there.
    backend, recorder = VersionBackend(7), Recorder()
    client = VersionClient()
    driver = RolloutDriver(client, plugin_set(backend, recorder))  # type: ignore[arg-type]
    assert await driver.publish_version("batch-1") == 7
    assert client.published == [7] and recorder.versions == [7]
    assert backend.batches == ["batch-1"]

    silent = RolloutDriver(client, plugin_set(VersionBackend(None), recorder))  # type: ignore[arg-type]
    assert await silent.publish_version("batch-2") is None
    assert client.published == [7] and recorder.versions == [7]  # nothing to publish


class LLMRequests:
    """Observes `prorl_llm_request`."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int, str | None]] = []

    @hookimpl
    def prorl_llm_request(self, server: str, prompt_tokens: int, response_tokens: int, error: str | None) -> None:
        self.seen.append((server, prompt_tokens, response_tokens, error))


@on_virtual_time
async def test_the_llm_pool_reports_every_request_answered_or_not():
    requests = LLMRequests()
    async with ScriptedLLM() as llm:
        llm.cue(Fail(500, "overloaded"), "hi")
        pool = LLMPool([llm.url], plugins=plugin_set(requests))
        await pool.start()
        try:
            generation = await pool.generate([1, 2, 3], SamplingParams(max_tokens=16), Pin())
        finally:
            await pool.close()
    [(server, prompt, response, error), answered] = requests.seen
    assert (server, prompt, response) == (llm.url, 3, 0) and "overloaded" in error
    assert answered == (llm.url, 3, len(generation.token_ids), None)


# -- `prorl-rollout plugins`: PluginSet.describe() and the configuration check ------------------------------
def test_prorl_rollout_plugins_lists_the_plugins_their_hooks_and_the_tasks(capsys):
    assert main(["plugins", "--block-plugin", "staleness"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "builtin_tasks: prorl_plugins.tasks hooks=prorl_register_tasks" in lines
    assert "reward_shaping: RewardShaping hooks=prorl_combine_reward,prorl_reward_components" in lines
    assert "staleness: blocked" in lines
    assert "task shell: prorl_plugins.tasks.shell.ShellTask" in lines


def test_prorl_rollout_plugins_checks_a_configuration_file_as_start_up_would(capsys, tmp_path):
    good, bad, typo = tmp_path / "good.json", tmp_path / "bad.json", tmp_path / "typo.json"
    good.write_text('{"staleness": {"mode": "pace", "max_staleness": 2, "batch_size": 256}}')
    bad.write_text('{"staleness": {"mode": "drop"}}')
    typo.write_text('{"stalenes": {"mode": "off"}}')
    assert main(["plugins", "--plugin-config", str(good)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"configuration {good}: accepted"
    assert main(["plugins", "--plugin-config", str(bad)]) == 2
    assert capsys.readouterr().out == (
        "prorl-rollout: staleness plugin: staleness.max_staleness: required in mode 'drop'\n"
    )
    assert main(["plugins", "--plugin-config", str(typo)]) == 2
    assert "has unknown section(s) 'stalenes'; the loaded plugins read: " in capsys.readouterr().out
