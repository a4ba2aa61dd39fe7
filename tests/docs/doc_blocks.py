"""The code blocks of the README, docs/*.md and examples/*/README.md, run as tests (Sybil), against real servers.

A pytest plugin, loaded by the root conftest.py. Each ```python block runs in its document's namespace (so a
later block sees an earlier one's names), each ```bash block runs as `bash -euo pipefail` from a view of the
clone's root in a temporary directory (also its HOME), with the project's virtualenv first on PATH, and each
```verl block (lines a verl recipe adds) goes through verl's pre-flight with the document's earlier ones; a block of
examples/X/README.md runs with examples/X on the Python path, as its prose says. A block that cannot run here is
preceded by `<!-- skip: next "the reason" -->`, which Sybil reads (the reason is what pytest reports), and by a
visible note saying why (test_doc_blocks.py checks both).

Servers start only for the blocks that read their address, and once per test session: a block that mentions
`PRORL_SANDBOX_URL` gets a bwrap sandbox runtime there, `PRORL_LLM_URL` vLLM serving the tiny model (whose
tokenizer is `PRORL_TOKENIZER`), `PRORL_ROLLOUT_URL` the rollout service on both, with the example plugins loaded: the
countdown plugin (examples/custom_plugin) by import path, or by its entry point where it is installed, and the
first hour's (examples/first_hour) as its README starts the service. The blocks
read these variables with the addresses a newcomer's servers have as defaults
(`${PRORL_SANDBOX_URL:-http://127.0.0.1:8765}`), so they are copied as printed and the tests need no fixed port.

Collection: `pytest README.md docs/runtime.md` takes the documents themselves; `pytest tests/docs` (and so a bare
`pytest`, through testpaths, and `make test`) takes every document, here in the `tests/docs` directory node;
`pytest .` meets them both ways, and each document is collected once: by tests/docs when it is collected,
unless the document is named itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import NoReturn

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.integration.pytest import SybilFile, SybilItem
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

from prorl_adapter.dev import localstack
from prorl_adapter.dev.localstack import REPO, Service

HERE = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
COUNTDOWN = REPO / "examples" / "custom_plugin"
FIRST_HOUR = REPO / "examples" / "first_hour"
FIRST_HOUR_PLUGIN = "my_plugin:LinesPlugin"  # as its README starts the service with it
BASH_TIMEOUT_S = 600


def pythonpath(env: Mapping[str, str], *folders: Path) -> str:
    """`env`'s PYTHONPATH with `folders` first."""
    return os.pathsep.join(filter(None, [*map(str, folders), env.get("PYTHONPATH")]))


def documents() -> list[Path]:
    """The Markdown files whose blocks are tested (the generated references in docs/openapi/ are not)."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("examples/*/README.md"))]


def missing(what: str) -> NoReturn:
    """A server's prerequisite is not installed: its blocks skip, except under PRORL_REQUIRE_BACKENDS (`make test`,
    hence CI), where, as the root conftest.py's rule says, a missing part is a broken install to report."""
    if os.environ.get("PRORL_REQUIRE_BACKENDS"):
        pytest.fail(f"PRORL_REQUIRE_BACKENDS is set but {what}", pytrace=False)
    pytest.skip(what)


class DocServers:
    """The servers the blocks talk to, each started on first use and stopped at the end of the session.

    A server that failed to start is not started again in this session: its first failure fails every later
    block that needs it at once (one start may wait 600 s for vLLM; every block waiting again would be hours)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.services: dict[str, Service] = {}
        self.failed: dict[str, str] = {}  # a server's name: why its first start failed
        self.state_dir: Path | None = None

    def _start(self, name: str, start: Callable[[], Service]) -> str:
        """The URL of server `name`, started by `start` if it is not running, unless it failed before."""
        if name in self.failed:
            pytest.fail(f"the {name} server failed to start earlier in this run: {self.failed[name]}", pytrace=False)
        if name not in self.services:
            try:
                self.services[name] = start()
            except Exception as exc:
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                raise
        return self.services[name].url

    def sandbox_url(self) -> str:
        if "sandbox" not in self.services and "sandbox" not in self.failed and shutil.which("bwrap") is None:
            missing("bubblewrap is not installed (apt-get install bubblewrap; make test does)")
        return self._start("sandbox", self._start_sandbox)

    def _start_sandbox(self) -> Service:
        # Its sandboxes' uids (under a root server) must traverse to the state dir: not pytest's 0700 tmp.
        self.state_dir = Path(tempfile.mkdtemp(prefix="prorl-docs-state-"))
        try:
            self.state_dir.chmod(0o711)
            log = self.workdir / "sandbox-runtime.log"
            return localstack.start_sandbox_runtime(self.state_dir, None, *localstack.agent_env_args(), log=log)
        except BaseException:
            self._remove_state_dir()
            raise

    def llm_url(self) -> str:
        if "llm" not in self.services and "llm" not in self.failed and not localstack.VLLM_PYTHON.exists():
            missing("the vLLM environment is missing: run scripts/vllm-env.sh (make test does)")
        return self._start("llm", self._start_llm)

    def _start_llm(self) -> Service:
        localstack.build_tiny_model()
        return localstack.start_vllm(log=self.workdir / "vllm.log")

    def rollout_url(self) -> str:
        return self._start("rollout", self._start_rollout)

    def _start_rollout(self) -> Service:
        sandbox, llm = self.sandbox_url(), self.llm_url()  # each remembers its own failure to start
        config = self.workdir / "plugins.json"
        config.write_text(json.dumps({"countdown": {"repeat_penalty": 0.1}}))  # as the custom plugin README's
        countdown = ("--plugin-config", str(config))
        if not entry_points(group="prorl_adapter", name="countdown"):  # else installed, as its README shows
            countdown = ("--plugin", "prorl_plugin_countdown.plugin:CountdownPlugin", *countdown)
        first_hour = ("--plugin", FIRST_HOUR_PLUGIN)
        with pytest.MonkeyPatch.context() as patch:  # the service imports the example plugins from their folders
            patch.setenv("PYTHONPATH", pythonpath(os.environ, FIRST_HOUR, COUNTDOWN))
            return localstack.start_rollout_service(
                [sandbox], [llm], *countdown, *first_hour, log=self.workdir / "rollout-service.log"
            )

    def env_for(self, source: str) -> dict[str, str]:
        """The variables `source` reads, each with the address of a server started for it."""
        env: dict[str, str] = {}
        if "PRORL_SANDBOX_URL" in source:
            env["PRORL_SANDBOX_URL"] = self.sandbox_url()
        if "PRORL_LLM_URL" in source or "PRORL_TOKENIZER" in source:
            env["PRORL_LLM_URL"] = self.llm_url()
            env["PRORL_TOKENIZER"] = str(localstack.TINY_MODEL)
        if "PRORL_ROLLOUT_URL" in source:
            env["PRORL_ROLLOUT_URL"] = self.rollout_url()
        return env

    def stop(self) -> None:
        """Stop what was started; a later block that needs a server starts it again."""
        for service in reversed(list(self.services.values())):
            service.stop()
        self.services.clear()
        self._remove_state_dir()

    def _remove_state_dir(self) -> None:
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir = None


@pytest.fixture(scope="session")
def doc_servers(tmp_path_factory) -> Iterator[DocServers]:
    servers = DocServers(tmp_path_factory.mktemp("doc-servers"))
    yield servers
    servers.stop()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The docs' servers stop as soon as the run leaves the docs' blocks (`make test` goes on to the integration
    tests, which start servers of their own: two vLLMs at once would only compete for the cores)."""
    if isinstance(item, SybilItem) and not isinstance(nextitem, SybilItem):
        servers = item.funcargs.get("doc_servers")
        if isinstance(servers, DocServers):
            servers.stop()


def servers_of(example: Example) -> DocServers:
    return example.namespace["doc_servers"]


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        yield


class PythonBlocks(PythonCodeBlockParser):
    """```python blocks, run by Sybil's own evaluator with the variables they read set."""

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in super().__call__(document):
            region.evaluator = with_servers(region.evaluator)
            yield region


def example_dir(example: Example) -> Path | None:
    """examples/X for a block of examples/X/README.md: its prose runs the blocks with that folder on PYTHONPATH."""
    path = Path(example.path).resolve()
    return path.parent if path.parent.parent == REPO / "examples" else None


def with_servers(evaluate):
    def evaluate_with_servers(example: Example) -> str | None:
        with environment(servers_of(example).env_for(str(example.parsed))), pytest.MonkeyPatch.context() as patch:
            if (folder := example_dir(example)) is not None:
                patch.syspath_prepend(str(folder))
            return evaluate(example)

    return evaluate_with_servers


def clone_view(directory: Path) -> None:
    """Make `directory` look like the clone's root, where a newcomer runs the blocks (`python examples/...`): a link
    to each of the clone's top-level entries. What a block writes there stays in `directory`."""
    for entry in REPO.iterdir():
        if not entry.name.startswith("."):
            (directory / entry.name).symlink_to(entry)


def run_command(argv: list[str], cwd: Path, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """`argv` run to its end, what it printed (stdout and stderr, interleaved) in `stdout`."""
    return subprocess.run(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=BASH_TIMEOUT_S
    )


def run_bash(example: Example) -> str | None:
    """A ```bash block as a newcomer runs it: `bash -euo pipefail`, the virtualenv's commands first on PATH, from
    the clone's root (a view of it in a temporary directory, which is also HOME); its failure (a non-zero status)
    is reported with what it printed."""
    source = str(example.parsed)
    env = {**os.environ, **servers_of(example).env_for(source)}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    if (folder := example_dir(example)) is not None:
        env["PYTHONPATH"] = pythonpath(env, folder)
    with tempfile.TemporaryDirectory(prefix="prorl-docs-bash-") as cwd:
        clone_view(Path(cwd))
        env["HOME"] = cwd
        done = run_command(["bash", "-euo", "pipefail", "-c", source], Path(cwd), env)
    if done.returncode != 0:
        return f"the bash block exited with status {done.returncode}; it printed:\n{done.stdout}"
    return None


ROLLOUT_HOST = "http://<rollout-host>:8766"  # the docs' placeholder for the rollout service in verl lines


def verl_overrides(source: str) -> list[str]:
    """The overrides of a ```verl block, as the shell would split them (a `#` starts a comment)."""
    return [word for line in source.splitlines() for word in shlex.split(line, comments=True)]


def check_verl_lines(example: Example) -> str | None:
    """A ```verl block: lines a verl recipe adds, which the pre-flight (`python -m prorl_plugins.verl.check`) must
    pass with the document's earlier ```verl blocks (a later block adds to them, as the prose does), the
    placeholder host being the docs' rollout service, which the pre-flight asks for its tasks and sections."""
    lines = example.namespace.setdefault("verl_lines", [])
    lines += verl_overrides(str(example.parsed))
    service = servers_of(example).rollout_url()
    argv = [line.replace(ROLLOUT_HOST, service) for line in lines]
    done = run_command([sys.executable, "-m", "prorl_plugins.verl.check", *argv], REPO)
    if done.returncode != 0:
        return f"the pre-flight refused the verl lines {argv} (status {done.returncode}):\n{done.stdout}"
    return None


SYBIL = Sybil(
    parsers=[
        SkipParser(),
        PythonBlocks(),
        CodeBlockParser("bash", run_bash),
        CodeBlockParser("verl", check_verl_lines),
    ],
    path=str(REPO),
    fixtures=["doc_servers"],
)


def sybil_file(parent: pytest.Collector, path: Path) -> SybilFile:
    return SybilFile.from_parent(parent, path=path, sybils=[SYBIL])


def arg_paths(config: pytest.Config) -> list[Path]:
    """The paths the run was asked to collect (the command line's, else testpaths), resolved."""
    base = config.invocation_params.dir
    return [(base / arg.split("::")[0]).resolve() for arg in config.args]


def named_documents(config: pytest.Config) -> set[Path]:
    """The documents named themselves on the command line (`pytest README.md`): collected as files, not by
    DocsDirectory."""
    return set(arg_paths(config)) & set(documents())


def docs_directory_collected(config: pytest.Config) -> bool:
    """Whether DocsDirectory (tests/docs) is in what the run collects: a bare `pytest` (testpaths), `pytest .`,
    `pytest tests`, `pytest tests/docs`, `make test`."""
    return any(path == HERE or path in HERE.parents for path in arg_paths(config))


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> SybilFile | None:
    """A document named on the command line (`pytest README.md docs/runtime.md`), or met while pytest walks a
    directory (`pytest docs`) when tests/docs, which takes every document, is not collected too (`pytest .`
    meets them both ways: a document is collected once, by one of them)."""
    path = file_path.resolve()
    if file_path.suffix != ".md" or path not in documents():
        return None
    config = parent.config
    if path in named_documents(config) or not docs_directory_collected(config):
        return sybil_file(parent, file_path)
    return None


class DocsDirectory(pytest.Directory):
    """tests/docs: its test modules, if any, and every tested document not named on the command line (whose
    nodes keep their own paths)."""

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        for path in sorted(self.path.glob("test_*.py")):
            yield from self.ihook.pytest_collect_file(file_path=path, parent=self)
        named = named_documents(self.config)
        for path in documents():
            if path.resolve() not in named:
                yield sybil_file(self, path)


def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if path.resolve() == HERE:
        return DocsDirectory.from_parent(parent, path=path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A skipped block is reported at its own line of its document, not where Sybil raised the skip."""
    report = yield
    if isinstance(item, SybilItem) and report.skipped and isinstance(report.longrepr, tuple):
        path = os.path.relpath(item.example.path, item.config.rootpath)
        report.longrepr = (path, item.example.line, report.longrepr[2])
    return report
