"""Harbor's task directory, read: what the `harbor` task (harbor.py) and its oracle check (harbor_check.py) know of a
task, checked once, with an error naming the file for whatever is wrong.

A Harbor task is a directory (Harbor, Terminal-Bench 2.0, SkyRL, rLLM and TRL read the same layout):

    hello-world/
        task.toml          [metadata], [verifier], [agent], [environment], [solution]; schema_version (or version)
        instruction.md     the prompt
        environment/       Dockerfile and its build context: the user builds the image from it (docs/harbor.md)
        tests/test.sh      the verifier: writes /logs/verifier/reward.txt (a number) or reward.json (named numbers)
        solution/solve.sh  optional: the oracle, which must score 1

A dataset is a directory of such directories (one without a task.toml of its own).

Why not Harbor's own package (`harbor` on PyPI, whose `harbor.models.task.config.TaskConfig` this mirrors): it needs
Python 3.12 or newer (this project runs on 3.11), and it brings litellm, fastapi, uvicorn, supabase, typer and rich's
stack for its own CLI, runners and registry, for what is here one TOML file of a few fields. So task.toml is read with
`tomllib` into the pydantic models below, which keep Harbor's field names and defaults (harbor 0.25.0), read its
deprecated spellings as Harbor does (`version` for `schema_version`, `memory`/`storage` as "2G"), and ignore keys
they do not know, as Harbor's models do. What the service cannot honour (several steps, a separate verifier
environment, GPUs, docker-compose services) is refused with the file that asks for it.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prorl_adapter.tasks import TaskConfigError

# Harbor's task.toml schema versions, up to the one harbor 0.25.0 writes. A newer one may mean what this reader
# does not know: refused rather than half-read.
SCHEMA_VERSIONS = ("1.0", "1.1", "1.2", "1.3", "1.4")
# Where Harbor's containers hold what a task's scripts name (harbor.models.trial.paths.EnvironmentPaths).
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
LOGS_DIR = "/logs"
VERIFIER_DIR = "/logs/verifier"
REWARD_TEXT = "reward.txt"
REWARD_JSON = "reward.json"
# Harbor's reward.json entry that is the trial's reward (harbor's `_primary_reward`).
PRIMARY_REWARD = "reward"
DEFAULT_WORKDIR = "/app"  # Harbor's own tasks' WORKDIR, where an image names none
MAX_TASK_FILE_BYTES = 64 << 20  # tests/ or solution/ in all: what a task brings into a sandbox at eval
_WORKDIR_LINE = re.compile(r"^\s*WORKDIR\s+(\S+)\s*$", re.IGNORECASE | re.MULTILINE)
_COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


class _Section(BaseModel):
    # Harbor's models ignore keys they do not know: a task written for a newer Harbor still loads.
    model_config = ConfigDict(extra="ignore")


class VerifierSection(_Section):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    user: str | int | None = None
    environment_mode: str | None = None
    environment: dict[str, Any] | None = None


class AgentSection(_Section):
    timeout_sec: float | None = Field(None, gt=0)
    user: str | int | None = None


class SolutionSection(_Section):
    env: dict[str, str] = Field(default_factory=dict)


class EnvironmentSection(_Section):
    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    cpus: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    storage_mb: int | None = Field(None, gt=0)
    gpus: int | None = Field(None, ge=0)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    network_mode: str | None = None
    allow_internet: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_sizes(cls, data: Any) -> Any:
        """Harbor's deprecated `memory = "2G"` and `storage = "10G"`, as Harbor reads them."""
        if isinstance(data, dict):
            data = dict(data)
            for old, new in (("memory", "memory_mb"), ("storage", "storage_mb")):
                if isinstance(data.get(old), str):
                    data.setdefault(new, _size_mb(data.pop(old)))
        return data


class TaskToml(_Section):
    """task.toml, as Harbor's TaskConfig reads it (the fields this service uses or must refuse)."""

    schema_version: str = "1.4"
    metadata: dict[str, Any] = Field(default_factory=dict)
    task: dict[str, Any] | None = None
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    solution: SolutionSection = Field(default_factory=SolutionSection)
    steps: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _version_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "version" in data:
            data = dict(data)
            data.setdefault("schema_version", data.pop("version"))
        return data


def _size_mb(text: str) -> int:
    size = text.strip().upper()
    factor = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}.get(size[-1:])
    try:
        if factor is None:
            raise ValueError
        return int(float(size[:-1]) * factor)
    except ValueError:
        raise ValueError(f"{text!r} is not a size such as '2G' or '512M'") from None


@dataclass(frozen=True)
class HarborTaskDir:
    """A checked Harbor task directory."""

    path: Path  # absolute, resolved
    name: str  # the directory's name
    package: str | None  # [task].name ("org/name"), where task.toml has one
    instruction: str
    config: TaskToml
    workdir: str  # where the agent works: [environment].workdir, else the Dockerfile's WORKDIR, else /app
    workdir_from_image: bool  # whether the image holds the workdir (it is seeded from there) or not (empty)
    has_solution: bool

    @property
    def tests(self) -> Path:
        return self.path / "tests"

    @property
    def solution(self) -> Path:
        return self.path / "solution"


def load_task(path: str | Path) -> HarborTaskDir:
    """The Harbor task at `path`, checked: TaskConfigError naming the file that is missing or wrong."""
    root = Path(path)
    if not root.is_absolute():
        raise TaskConfigError(f"a Harbor task's path must be absolute, not {str(path)!r}")
    root = root.resolve()
    if not root.is_dir():
        raise TaskConfigError(f"{root} is not a directory (a Harbor task directory)")
    for part in ("task.toml", "instruction.md", "tests/test.sh", "solution/solve.sh", "environment/Dockerfile"):
        no_link(root, part)
    config = read_task_toml(root / "task.toml")
    instruction_path = root / "instruction.md"
    try:
        instruction = instruction_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskConfigError(f"{instruction_path}: cannot be read ({_reason(exc)})") from None
    if not instruction.strip():
        raise TaskConfigError(f"{instruction_path} is empty: it is the task's prompt")
    test_script = root / "tests" / "test.sh"
    if not test_script.is_file():
        raise TaskConfigError(f"{test_script} is missing: it is the task's verifier")
    for name in _COMPOSE_FILES:
        if (root / "environment" / name).exists():
            raise TaskConfigError(
                f"{root / 'environment' / name}: docker-compose services are not supported (one sandbox per episode)"
            )
    workdir, from_image = _workdir(root, config)
    package = (config.task or {}).get("name")
    return HarborTaskDir(
        path=root,
        name=root.name,
        package=package if isinstance(package, str) else None,
        instruction=instruction,
        config=config,
        workdir=workdir,
        workdir_from_image=from_image,
        has_solution=(root / "solution" / "solve.sh").is_file(),
    )


def no_link(root: Path, relative: str) -> None:
    """TaskConfigError where `relative` or a directory on its way below `root` is a symbolic link: what the service
    reads of a task, on its own host, stays inside the task directory (a link could lead to any file it can read,
    into a prompt or a sandbox)."""
    path = root
    for part in Path(relative).parts:
        path = path / part
        if path.is_symlink():
            raise TaskConfigError(f"{path} is a symbolic link: a task's files are read in place, never followed")


def read_task_toml(path: Path) -> TaskToml:
    """task.toml checked: its schema version known, nothing asked that a sandbox here cannot give."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TaskConfigError(f"{path} is missing: a Harbor task directory holds task.toml") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TaskConfigError(f"{path}: cannot be read ({_reason(exc)})") from None
    try:
        config = TaskToml.model_validate(data)
    except (ValidationError, ValueError) as exc:
        raise TaskConfigError(f"{path}: {_validation_message(exc)}") from None
    if config.schema_version not in SCHEMA_VERSIONS:
        raise TaskConfigError(
            f"{path}: schema version {config.schema_version!r} is not one this service reads "
            f"({', '.join(SCHEMA_VERSIONS)})"
        )
    if config.steps:
        raise TaskConfigError(f"{path}: multi-step tasks ([[steps]]) are not supported")
    if config.verifier.environment is not None or config.verifier.environment_mode == "separate":
        raise TaskConfigError(f"{path}: a separate verifier environment ([verifier].environment) is not supported")
    if config.environment.gpus:
        raise TaskConfigError(f"{path}: [environment].gpus = {config.environment.gpus}: sandboxes here have no GPU")
    return config


def _workdir(root: Path, config: TaskToml) -> tuple[str, bool]:
    """Where the agent works, as Harbor's container has it: [environment].workdir, else the Dockerfile's last WORKDIR
    (which Docker makes, so the image holds it), else /app, empty."""
    if config.environment.workdir:
        return _absolute(config.environment.workdir, root / "task.toml"), True
    dockerfile = root / "environment" / "Dockerfile"
    try:
        lines = _WORKDIR_LINE.findall(dockerfile.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        lines = []
    if lines and lines[-1].strip("\"'") not in ("/", ""):
        return _absolute(lines[-1].strip("\"'"), dockerfile), True
    return DEFAULT_WORKDIR, False


def _absolute(workdir: str, source: Path) -> str:
    if not workdir.startswith("/") or ".." in workdir.split("/") or "$" in workdir:
        raise TaskConfigError(f"{source}: workdir {workdir!r} must be an absolute path without '..' or variables")
    return workdir.rstrip("/")


def dataset_tasks(path: str | Path) -> list[Path]:
    """The task directories a path names: itself where it holds a task.toml, else its subdirectories that do
    (a dataset), in name order. TaskConfigError where it names neither."""
    root = Path(path).resolve()
    if (root / "task.toml").is_file():
        return [root]
    if not root.is_dir():
        raise TaskConfigError(f"{root} is not a directory (a Harbor task or a dataset of them)")
    tasks = sorted(child for child in root.iterdir() if child.is_dir() and (child / "task.toml").is_file())
    if not tasks:
        raise TaskConfigError(f"{root} holds no task.toml, nor any directory that does: not a Harbor dataset")
    return tasks


# --- Rewards ------------------------------------------------------------------------------------------------------


def parse_reward(name: str, data: bytes) -> dict[str, float]:
    """The reward components of a verifier's reward file (`name`: reward.txt or reward.json, for the message),
    or TaskConfigError naming the file.

    reward.txt holds one number: the component `outcome`. reward.json holds named numbers, read as Harbor reads
    them: its entry `reward` (else its only entry) is the task's reward, the component `outcome`, and its other
    entries are metrics beside it (kept in the artifact `verifier_rewards`, not added to the reward: a file like
    {"reward": 1, "tests_passed": 17} scores 1). A file of several entries and none named `reward` is a reward
    made of parts: each entry is a component under its own name (beside an `outcome` of 0, unless one of them is
    named so), and the reward is their sum unless a reward plugin weights them (docs/plugins.md)."""
    text = data.decode("utf-8", errors="replace").strip()
    if not text:
        raise TaskConfigError(f"the verifier's {name} is empty")
    if name == REWARD_TEXT:
        return {"outcome": _number(text, name)}
    try:
        rewards = json.loads(text)
    except ValueError:
        raise TaskConfigError(f"the verifier's {name} is not JSON: {text[:200]!r}") from None
    if not isinstance(rewards, dict) or not rewards:
        raise TaskConfigError(f"the verifier's {name} must be an object of named numbers, not {text[:200]!r}")
    values = {str(key): _number(value, name, str(key)) for key, value in rewards.items()}
    if PRIMARY_REWARD in values:
        return {"outcome": values[PRIMARY_REWARD]}
    if len(values) == 1:
        return {"outcome": next(iter(values.values()))}
    return {"outcome": values.pop("outcome", 0.0), **values}  # the service's eval always has an `outcome`


def _number(value: Any, name: str, key: str | None = None) -> float:
    where = f"{name}'s {key!r}" if key is not None else name
    if isinstance(value, bool):
        raise TaskConfigError(f"the verifier's {where} is {value!r}, not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TaskConfigError(f"the verifier's {where} is {str(value)[:200]!r}, not a number") from None
    if not math.isfinite(number):
        raise TaskConfigError(f"the verifier's {where} is {number}, not a finite number")
    return number


# --- Harbor's paths, in a sandbox whose root is read-only ----------------------------------------------------------

# An absolute path that starts with one of Harbor's fixed directories, as a word of its own (not `/app/tests`).
_HARBOR_PATH = re.compile(r"(?<![\w.~$/])(/tests|/solution|/logs)(?![\w.-])")


def relocated(content: bytes, base: str) -> bytes:
    """`content` (a text file of tests/ or solution/) with Harbor's fixed paths, /tests, /solution and /logs, moved
    below `base`: a sandbox here may write only its workspace and /tmp, so eval gives the verifier those
    directories in /tmp. Binary files (not UTF-8) are left as they are."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return content
    return _HARBOR_PATH.sub(lambda match: base + match[1], text).encode("utf-8")


def task_files(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every regular file below `directory` (tests/ or solution/): relative path -> (content, mode). Links are
    refused (they could lead out of the task directory on the service's host), and so is more than
    MAX_TASK_FILE_BYTES."""
    files: dict[str, tuple[bytes, int]] = {}
    total = 0
    if directory.is_symlink():
        raise TaskConfigError(f"{directory} is a symbolic link: a task's files are copied, never followed")
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if path.is_symlink():
            raise TaskConfigError(f"{path} is a symbolic link: a task's files are copied, never followed")
        if path.is_file():
            content = path.read_bytes()
            total += len(content)
            if total > MAX_TASK_FILE_BYTES:
                raise TaskConfigError(f"{directory} holds over {MAX_TASK_FILE_BYTES >> 20} MiB")
            files[relative] = (content, 0o755 if path.stat().st_mode & 0o100 else 0o644)
    return files


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _validation_message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'task.toml'}: {error['msg']}" for error in exc.errors()
        )
    return str(exc)


def template_fields(task: HarborTaskDir, dataset: str | None = None) -> Mapping[str, str]:
    """The fields of an image template: {name} (the task directory's name), {task} ([task].name with its '/', else
    the directory's name), {dataset} (the dataset directory's name, where the task is one of a dataset's)."""
    return {"name": task.name, "task": task.package or task.name, "dataset": dataset or task.path.parent.name}
