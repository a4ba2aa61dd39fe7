"""The `harbor` task without a sandbox: task.toml as Harbor reads it, bad task directories refused naming the file,
rewards read as Harbor reads them, Harbor's fixed paths moved into /tmp, the instance's directory, image, sandbox
and tools, the agent's time, and eval against a scripted sandbox (prorl_adapter.testing)."""

from __future__ import annotations

import io
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from prorl_adapter.tasks import EpisodeState, TaskConfigError
from prorl_adapter.testing import ScriptedSandbox
from prorl_plugins.tasks import harbor_format
from prorl_plugins.tasks.harbor import DEFAULT_TOOLS, HarborTask, _tar
from prorl_plugins.tasks.harbor_check import Checked, table
from prorl_plugins.tasks.harbor_check import main as check_main
from prorl_plugins.tasks.harbor_format import load_task, parse_reward, relocated
from tests.harbor_tasks import TASK_TOML, calc_task, dataset, hello_task


@pytest.fixture
def tasks(tmp_path) -> Path:
    return dataset(tmp_path / "tasks")


def refused(path: Path, *fragments: str) -> None:
    with pytest.raises(TaskConfigError) as error:
        load_task(path)
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)


# --- task.toml ---------------------------------------------------------------------------------------------------


def test_task_toml_is_read_with_harbors_fields_and_defaults(tasks):
    task = load_task(tasks / "hello-txt")
    assert task.name == "hello-txt" and task.package is None and task.has_solution
    assert task.instruction.startswith("Write the word hello")
    config = task.config
    assert config.schema_version == "1.0"  # `version`, Harbor's old spelling
    assert (config.verifier.timeout_sec, config.verifier.env) == (120.0, {"GREETING_FILE": "/app/hello.txt"})
    assert config.agent.timeout_sec == 300.0
    assert (config.environment.memory_mb, config.environment.storage_mb, config.environment.cpus) == (1024, 512, 1)
    assert (task.workdir, task.workdir_from_image) == ("/app", False)  # the Dockerfile names no WORKDIR


def test_deprecated_sizes_unknown_keys_and_the_newest_schema_are_read(tmp_path):
    toml = (
        'schema_version = "1.4"\nfuture_key = 1\n[task]\nname = "org/hello"\n'
        '[environment]\nmemory = "2G"\nstorage = "512M"\nnetwork_mode = "public"\nworkdir = "/srv/app"\n'
        "[verifier]\nnew_field = true\n"
    )
    task = load_task(_with_toml(tmp_path, toml))
    assert (task.config.environment.memory_mb, task.config.environment.storage_mb) == (2048, 512)
    assert task.config.verifier.timeout_sec == 600.0 and task.config.agent.timeout_sec is None
    assert task.package == "org/hello"
    assert (task.workdir, task.workdir_from_image) == ("/srv/app", True)


def _with_toml(root: Path, toml: str, name: str = "t") -> Path:
    task = hello_task(root, name)
    (task / "task.toml").write_text(toml)
    return task


def test_the_dockerfiles_last_workdir_is_where_the_agent_works(tmp_path):
    task = hello_task(tmp_path)
    (task / "environment" / "Dockerfile").write_text("FROM x\nWORKDIR /build\nRUN make\nworkdir /app/src\n")
    assert (load_task(task).workdir, load_task(task).workdir_from_image) == ("/app/src", True)


@pytest.mark.parametrize(
    ("toml", "fragments"),
    [
        ('version = "2.0"\n', ["task.toml", "schema version '2.0'", "1.4"]),
        ("version = \n", ["task.toml", "cannot be read"]),
        ('[verifier]\ntimeout_sec = "soon"\n', ["task.toml", "verifier.timeout_sec"]),
        ('[environment]\nmemory = "lots"\n', ["task.toml", "'lots' is not a size"]),
        ("[environment]\ngpus = 1\n", ["task.toml", "gpus = 1", "no GPU"]),
        ('[[steps]]\nname = "one"\n', ["task.toml", "multi-step"]),
        ('[verifier.environment]\ndocker_image = "x"\n', ["task.toml", "separate verifier"]),
        ('[environment]\nworkdir = "app"\n', ["task.toml", "workdir 'app'"]),
    ],
)
def test_a_bad_task_toml_is_refused_naming_it(tmp_path, toml, fragments):
    refused(_with_toml(tmp_path, toml), *fragments)


def test_missing_files_are_refused_naming_them(tmp_path):
    task = hello_task(tmp_path)
    (task / "tests" / "test.sh").unlink()
    refused(task, str(task / "tests" / "test.sh"), "verifier")
    (task / "instruction.md").unlink()
    refused(task, str(task / "instruction.md"))
    (task / "task.toml").unlink()
    refused(task, str(task / "task.toml"), "missing")
    refused(tmp_path / "nowhere", "not a directory")
    with pytest.raises(TaskConfigError, match="absolute"):
        load_task("relative/task")


def test_docker_compose_services_are_refused(tmp_path):
    task = hello_task(tmp_path)
    (task / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    refused(task, "docker-compose.yaml", "not supported")


def test_a_dataset_is_its_task_directories(tasks, tmp_path):
    assert [path.name for path in harbor_format.dataset_tasks(tasks)] == ["broken-oracle", "calc-json", "hello-txt"]
    assert harbor_format.dataset_tasks(tasks / "hello-txt") == [tasks / "hello-txt"]
    with pytest.raises(TaskConfigError, match="not a Harbor dataset"):
        harbor_format.dataset_tasks(tmp_path / "tasks" / "hello-txt" / "tests")


# --- rewards -----------------------------------------------------------------------------------------------------


def test_reward_txt_is_one_number():
    assert parse_reward("reward.txt", b"1\n") == {"outcome": 1.0}
    assert parse_reward("reward.txt", b" 0.25 ") == {"outcome": 0.25}


@pytest.mark.parametrize(
    ("data", "fragment"),
    [(b"yes\n", "reward.txt is 'yes', not a number"), (b"", "reward.txt is empty"), (b"nan", "not a finite")],
)
def test_a_reward_txt_that_is_not_a_number_is_an_error_naming_it(data, fragment):
    with pytest.raises(TaskConfigError, match=re.escape(fragment)):
        parse_reward("reward.txt", data)


def test_reward_json_entries_are_components_its_reward_entry_the_outcome():
    # The `reward` entry is the reward, the others metrics beside it: they never add to it.
    assert parse_reward("reward.json", b'{"reward": 0.5, "tests_passed": 17}') == {"outcome": 0.5}
    assert parse_reward("reward.json", b'{"reward": 0, "outcome": 1}') == {"outcome": 0.0}
    assert parse_reward("reward.json", b'{"accuracy": 0.75}') == {"outcome": 0.75}  # the only entry, as Harbor
    # No `reward` entry and several: a reward of parts, each a component (their sum, unless a plugin weights them)
    assert parse_reward("reward.json", b'{"a": 0.5, "b": 0.25}') == {"outcome": 0.0, "a": 0.5, "b": 0.25}


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b'{"reward": "high"}', "reward.json's 'reward' is 'high', not a number"),
        (b'{"reward": true}', "reward.json's 'reward' is True"),
        (b"[1]", "reward.json must be an object"),
        (b"{", "reward.json is not JSON"),
        (b"{}", "reward.json must be an object"),
    ],
)
def test_a_reward_json_that_is_not_named_numbers_is_an_error_naming_it(data, fragment):
    with pytest.raises(TaskConfigError, match=re.escape(fragment)):
        parse_reward("reward.json", data)


# --- Harbor's paths --------------------------------------------------------------------------------------------


def test_harbors_fixed_paths_are_moved_below_the_eval_directory():
    base = "/tmp/harbor-x"
    script = b'cat /tests/expected.txt > "/logs/verifier/reward.txt"; cd /tests; ${T:-/tests}/a; '
    script += b"bash /solution/solve.sh"
    assert relocated(script, base) == (
        b'cat /tmp/harbor-x/tests/expected.txt > "/tmp/harbor-x/logs/verifier/reward.txt"; cd /tmp/harbor-x/tests; '
        b"${T:-/tmp/harbor-x/tests}/a; bash /tmp/harbor-x/solution/solve.sh"
    )
    untouched = b"/app/tests/x ./tests /testsuite /logs2 $HOME/tests ~/tests /tests.d"
    assert relocated(untouched, base) == untouched
    assert relocated(b"\xff/tests", base) == b"\xff/tests"  # not text: as it is


def test_links_in_a_tasks_files_are_refused(tmp_path):
    task = hello_task(tmp_path)
    (task / "tests" / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(TaskConfigError, match="symbolic link"):
        harbor_format.task_files(task / "tests")


# --- the instance ------------------------------------------------------------------------------------------------


def test_a_task_directory_must_lie_below_an_allowed_one(tasks, tmp_path, monkeypatch):
    monkeypatch.delenv("PRORL_HARBOR_DATASETS", raising=False)
    with pytest.raises(TaskConfigError, match="PRORL_HARBOR_DATASETS"):
        HarborTask().task({"path": str(tasks / "hello-txt")})
    monkeypatch.setenv("PRORL_HARBOR_DATASETS", f"/nowhere:{tasks}")
    assert HarborTask().task({"path": str(tasks / "hello-txt")}).name == "hello-txt"
    handler = HarborTask(datasets=[tasks])
    assert handler.task({"dataset": str(tasks), "task": "calc-json"}).name == "calc-json"
    (tmp_path / "outside").mkdir()
    (tasks / "escape").symlink_to(hello_task(tmp_path / "outside"))
    for instance, fragment in [
        ({"path": str(tasks / "escape")}, "not below a directory"),
        ({"path": str(tasks / ".." / "outside" / "hello-txt")}, "not below a directory"),
        ({"dataset": str(tasks), "task": "../outside"}, "directory name"),
        ({"task": "hello-txt"}, "'path'"),
    ]:
        with pytest.raises(TaskConfigError, match=fragment):
            handler.task(instance)


def test_the_image_is_named_by_a_template(tasks, monkeypatch):
    monkeypatch.delenv("PRORL_HARBOR_IMAGE_TEMPLATE", raising=False)
    handler = HarborTask(datasets=[tasks])
    task = handler.task({"path": str(tasks / "hello-txt")})
    assert handler.image({}, task) == "harbor/hello-txt"
    monkeypatch.setenv("PRORL_HARBOR_IMAGE_TEMPLATE", "tb2/{dataset}/{name}.sif")
    assert handler.image({}, task) == "tb2/tasks/hello-txt.sif"
    assert handler.image({"image_template": "{task}.oci:latest"}, task) == "hello-txt.oci:latest"
    assert HarborTask(image_template="x/{name}").image({}, task) == "x/hello-txt"
    assert handler.image({"image": "debian-python.rootfs"}, task) == "debian-python.rootfs"
    for instance, fragment in [({"image": "/etc"}, "not an image name"), ({"image_template": "{nope}"}, "takes")]:
        with pytest.raises(TaskConfigError, match=fragment):
            handler.image(instance, task)


def test_the_sandbox_is_the_tasks_image_workdir_and_limits(tasks):
    handler = HarborTask(datasets=[tasks], image_template="harbor/{name}")
    assert handler.sandbox_spec({"path": str(tasks / "hello-txt")}) == {
        "image": "harbor/hello-txt",
        "workdir": "/app",
        "seed_workdir": False,
        "env": {},
        "limits": {"memory_mb": 1024, "pids": 1024, "disk_mb": 512},
    }
    assert handler.sandbox_spec({"path": str(tasks / "nothing")}) == {}  # init says what is wrong


async def test_environment_variables_from_the_hosts_environment_are_refused(tmp_path):
    task = _with_toml(tmp_path, TASK_TOML + '[environment.env]\nKEY = "${OPENAI_API_KEY}"\n')
    handler = HarborTask(datasets=[tmp_path])
    assert handler.sandbox_spec({"path": str(task)}) == {}
    with pytest.raises(TaskConfigError, match="host's environment"):
        await handler.init(ScriptedSandbox(), {"path": str(task)})


def test_the_prompt_is_the_instruction_and_the_tools_are_chosen_by_name(tasks):
    handler = HarborTask(datasets=[tasks])
    instance = {"path": str(tasks / "hello-txt")}
    assert handler.user_prompt(instance) == (tasks / "hello-txt" / "instruction.md").read_text()
    assert "/app" in handler.system_prompt(instance)
    assert [tool.name for tool in handler.tools(instance)] == list(DEFAULT_TOOLS)
    assert [tool.name for tool in handler.tools({**instance, "tools": ["bash"]})] == ["bash"]
    editor = ["bash", "str_replace_editor", "search", "finish"]  # the SWE editing tools, offered by name
    assert [tool.name for tool in handler.tools({**instance, "tools": editor})] == editor
    with pytest.raises(TaskConfigError, match="unknown tool 'browser'"):
        handler.tools({**instance, "tools": ["browser"]})
    assert handler.instance_id(instance) == "hello-txt"
    assert handler.instance_id({"dataset": str(tasks), "task": "calc-json"}) == "calc-json"


@dataclass(frozen=True)
class Sandbox(ScriptedSandbox):
    sandbox_id: str = "sb-1"


async def test_past_the_agents_time_the_tools_run_nothing(tasks):
    now = [100.0]
    handler = HarborTask(datasets=[tasks], clock=lambda: now[0])
    instance = {"path": str(tasks / "hello-txt")}
    box = Sandbox(answer=lambda call, box: "ran\n")
    await handler.init(box.for_task(), instance)
    bash = handler.tools(instance)[0]
    assert await bash.run(box, {"command": "make"}, EpisodeState()) == "ran\n[exit code 0]"
    now[0] += 300.0  # [agent].timeout_sec
    late = EpisodeState()
    answer = await bash.run(box, {"command": "make"}, late)
    assert "is up" in answer and "300" in answer and late.time_up  # the agent loop ends the episode on it
    assert late.time_limit_s == 300.0  # what the trajectory's cut says
    assert [call.command for call in box.calls] == ["make"]


# --- eval against a scripted sandbox -----------------------------------------------------------------------------


def verifier(reward_file: str | None, content: bytes = b"1\n", status: int = 0):
    """A scripted sandbox's answer: test.sh runs (status), and writes `reward_file` in its verifier directory."""

    def answer(call, box):
        if call.kind == "run" and "test.sh" in (call.command or ""):
            base = call.command.split("/tests/test.sh")[0].split()[-1]
            box.files[f"{base}/logs/verifier/test-stdout.txt.tail"] = b"tests ran\n"  # the script's tail of it
            if reward_file is not None:
                box.files[f"{base}/logs/verifier/{reward_file}"] = content
            return "", status
        return None

    return answer


async def test_eval_places_the_tests_only_now_runs_the_verifier_and_reads_the_reward(tasks):
    handler = HarborTask(datasets=[tasks])
    instance = {"path": str(tasks / "calc-json")}
    box = Sandbox(answer=verifier("reward.json", b'{"correctness": 1, "style": 0.2}'), workdir="/app")
    await handler.init(box.for_task(), instance)
    assert not any("/tests" in path or "grade" in path for path in box.files)  # nothing of the task before eval
    state = EpisodeState()
    assert await handler.evaluate(box.for_task(), instance, state) == {"outcome": 0.0, "correctness": 1.0, "style": 0.2}
    placed = {path for path in box.files if path.endswith(("/tests/test.sh", "/tests/grade.py"))}
    base = next(iter(placed)).split("/tests/")[0]
    assert base.startswith("/tmp/harbor-") and len(placed) == 2
    assert f"{base}/logs/verifier/reward.json" in box.files[f"{base}/tests/grade.py"].decode()
    run = next(call for call in box.calls if call.kind == "run")
    assert run.cwd == "/app" and run.env["HOME"].startswith("/tmp/check-home-") and run.env["PYTHONSAFEPATH"] == "1"
    assert run.env["GIT_CONFIG_VALUE_0"] == "/dev/null" and f": > {base}/pytest.ini" in run.command
    assert state.artifacts["verifier_log"] == "tests ran\n"
    assert json.loads(state.artifacts["verifier_rewards"]) == {"correctness": 1, "style": 0.2}


async def test_a_verifier_that_writes_no_reward_scores_zero_and_says_why(tasks):
    handler = HarborTask(datasets=[tasks])
    instance = {"path": str(tasks / "hello-txt")}
    state = EpisodeState()
    box = Sandbox(answer=verifier(None, status=127), workdir="/app")
    assert await handler.evaluate(box.for_task(), instance, state) == {"outcome": 0.0}
    assert "exit status 127" in state.artifacts["verifier_error"] and "reward.txt" in state.artifacts["verifier_error"]


async def test_a_reward_file_that_is_not_a_number_scores_zero_naming_it(tasks):
    """The code under test may write the reward file: what it wrote scores 0 and says why (`prorl-harbor check`
    shows it as a broken task), rather than failing the episode's eval."""
    handler = HarborTask(datasets=[tasks])
    box = Sandbox(answer=verifier("reward.txt", b"passed\n"), workdir="/app")
    state = EpisodeState()
    assert await handler.evaluate(box.for_task(), {"path": str(tasks / "hello-txt")}, state) == {"outcome": 0.0}
    assert "reward.txt is 'passed', not a number" in state.artifacts["verifier_error"]


def test_the_placed_files_keep_their_modes():
    with tarfile.open(fileobj=io.BytesIO(_tar({"test.sh": (b"/tests", 0o755), "d/x": (b"", 0o644)}, "/b"))) as tar:
        members = {member.name: (member.mode, tar.extractfile(member).read()) for member in tar.getmembers()}
    assert members == {"test.sh": (0o755, b"/b/tests"), "d/x": (0o644, b"")}


def test_calc_task_is_a_reward_json_task(tmp_path):
    assert "reward.json" in (calc_task(tmp_path) / "tests" / "grade.py").read_text()


# --- prorl-harbor check, without a runtime ---------------------------------------------------------------------


def test_the_check_table_says_which_task_is_broken_and_why():
    results = [
        Checked("hello-txt", 1.0, 0.0, ()),
        Checked("no-oracle", None, 0.0, ()),
        Checked("broken", 0.0, 1.0, ("the oracle scores 0, not 1", "the untouched sandbox scores 1, not 0")),
    ]
    assert table(results).splitlines() == [
        "task       oracle  untouched  verdict",
        "hello-txt  1       0          ok",
        "no-oracle  -       0          ok",
        "broken     0       1          BROKEN: the oracle scores 0, not 1; the untouched sandbox scores 1, not 0",
        "3 tasks, 1 broken",
    ]


def test_the_check_of_what_is_no_dataset_is_one_line_and_status_2(tmp_path, capsys):
    assert check_main(["check", str(tmp_path), "--sandbox-url", "http://127.0.0.1:9"]) == 2
    error = capsys.readouterr().err
    assert error == f"prorl-harbor: {tmp_path} holds no task.toml, nor any directory that does: not a Harbor dataset\n"


def test_a_workdir_that_would_hide_a_system_directory_is_refused_naming_the_task(tmp_path):
    task = hello_task(tmp_path)
    (task / "environment" / "Dockerfile").write_text("FROM x\nWORKDIR /usr/src/app\n")
    handler = HarborTask(datasets=[tmp_path])
    with pytest.raises(TaskConfigError, match="its workdir '/usr/src/app' cannot be a sandbox's"):
        handler.image({}, handler.task({"path": str(task)}))


@pytest.mark.parametrize("linked", ["instruction.md", "tests", "tests/test.sh", "task.toml"])
def test_a_task_file_that_is_a_link_is_refused_and_nothing_outside_is_read(tmp_path, linked):
    """A dataset's link to a file of the service's host (a key, a secret) would put it in a prompt or a sandbox."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "id_rsa").write_text("PRIVATE KEY")
    task = hello_task(tmp_path / "tasks")
    target = task / linked
    copy = outside / Path(linked).name
    (copy.mkdir() if target.is_dir() else copy.write_bytes(target.read_bytes()))
    if target.is_dir():
        for path in target.iterdir():
            (copy / path.name).write_bytes(path.read_bytes())
        (copy / "id_rsa").write_text("PRIVATE KEY")
        for path in target.iterdir():
            path.unlink()
        target.rmdir()
    else:
        target.unlink()
    target.symlink_to(copy)
    with pytest.raises(TaskConfigError, match="is a symbolic link"):
        load_task(task)
    if linked == "tests":
        with pytest.raises(TaskConfigError, match="is a symbolic link"):
            harbor_format.task_files(task / "tests")
