"""The harness that runs the docs' code blocks (doc_blocks.py): a block that fails is reported, a marked one is
skipped with its reason, a block gets the servers' addresses it reads, and every skip is visible to a reader."""

import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import SkipTest

import pytest
from sybil.example import SybilFailure

from tests.docs.doc_blocks import FIRST_HOUR, FIRST_HOUR_PLUGIN, SYBIL, DocServers, documents

SKIP = re.compile(r'^\s*<!-- skip: next "[^"]+" -->$')
VISIBLE = "*Not run by the docs tests"
FENCED = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


class FakeServers(DocServers):
    """Addresses without servers, for blocks that only print them."""

    def sandbox_url(self) -> str:
        return "http://127.0.0.1:1"

    def rollout_url(self) -> str:
        return "http://127.0.0.1:2"


def examples(tmp_path: Path, markdown: str):
    doc = tmp_path / "doc.md"
    doc.write_text(markdown)
    document = SYBIL.parse(doc)
    document.namespace["doc_servers"] = FakeServers(tmp_path)
    return list(document.examples())


def test_a_failing_bash_block_is_reported_with_its_status_and_output(tmp_path):
    (block,) = examples(tmp_path, "```bash\necho before\nfalse\necho after\n```\n")
    with pytest.raises(SybilFailure) as failure:
        block.evaluate()
    assert "exited with status 1" in str(failure.value) and "before" in str(failure.value)
    assert "after" not in str(failure.value)  # -e: the block stops at the first failing command


def test_a_bash_block_fails_on_a_failing_command_inside_a_pipe(tmp_path):
    (block,) = examples(tmp_path, "```bash\nfalse | cat\n```\n")
    with pytest.raises(SybilFailure):
        block.evaluate()


def test_a_python_block_that_raises_fails_and_blocks_share_their_document_namespace(tmp_path):
    first, second, third = examples(
        tmp_path, "```python\nx = 6 * 7\n```\n\n```python\nassert x == 42\n```\n\n```python\nassert x == 41, x\n```\n"
    )
    first.evaluate()
    second.evaluate()
    with pytest.raises(AssertionError, match="42"):
        third.evaluate()


def test_a_marked_block_is_skipped_with_its_reason(tmp_path):
    marker, block = examples(tmp_path, '<!-- skip: next "needs a GPU" -->\n```bash\nfalse\n```\n')
    marker.evaluate()
    with pytest.raises(SkipTest, match="needs a GPU"):
        block.evaluate()


def test_blocks_get_the_addresses_they_read_in_the_environment(tmp_path):
    sandbox, rollout = examples(
        tmp_path,
        '```bash\ntest "$PRORL_SANDBOX_URL" = http://127.0.0.1:1\n```\n\n'
        '```python\nimport os\nassert os.environ["PRORL_ROLLOUT_URL"] == "http://127.0.0.1:2"\n```\n',
    )
    sandbox.evaluate()
    rollout.evaluate()


def test_bash_blocks_run_from_a_view_of_the_clone_root_with_a_home_of_their_own(tmp_path):
    (block,) = examples(tmp_path, '```bash\ntest -f examples/custom_plugin/README.md\ntest "$HOME" = "$PWD"\n```\n')
    block.evaluate()


def test_a_verl_block_goes_through_the_pre_flight_with_the_documents_earlier_verl_blocks(tmp_path):
    """Its wrong line is named as the pre-flight names it, and a later block is checked with the earlier lines."""
    first, second = examples(
        tmp_path,
        "```verl\nactor_rollout_ref.model.external_lib=prorl_plugins.verl  # the plugin\n```\n\n"
        "```verl\nactor_rollout_ref.rollout.agent.default_agent_loop=prorl_agnt +prorl.task=python_math\n"
        "+prorl.service_url=http://<rollout-host>:8766\n```\n",
    )
    with pytest.raises(SybilFailure) as failure:
        first.evaluate()
    assert "the pre-flight refused" in str(failure.value)
    with pytest.raises(SybilFailure) as failure:
        second.evaluate()
    refusal = str(failure.value)
    assert "default_agent_loop=prorl_agnt is wrong" in refusal  # the pre-flight's own words, naming the line
    assert "'actor_rollout_ref.model.external_lib=prorl_plugins.verl'" in refusal  # the first block's line, kept
    assert "+prorl.service_url=http://127.0.0.1:2" in refusal  # the placeholder host is the docs' service


@pytest.mark.parametrize("path", documents(), ids=lambda path: str(path.relative_to(documents()[0].parent)))
def test_every_skipped_block_says_so_visibly(path):
    """A reader sees why a block is not run: each skip marker is followed by the note, and nothing else skips."""
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        if "<!-- skip" in line:
            assert SKIP.match(line), f'{path}:{number + 1}: a skip is written <!-- skip: next "reason" -->'
            assert lines[number + 1].lstrip().startswith(VISIBLE), f"{path}:{number + 2}: no visible note"
            assert lines[number + 2].lstrip().startswith("```"), f"{path}:{number + 3}: the block must follow"


def collected(*args: str) -> list[str]:
    """The node ids `pytest --collect-only -q ARGS` lists, run from the clone's root as a user runs it."""
    root = documents()[0].parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_each_document_is_collected_once_whichever_way_pytest_reaches_it():
    """`pytest .` reaches a document both as a file met in a directory and through tests/docs; named on the
    command line, it is collected as itself. Every way, each block is one test, and the same blocks."""
    alone = [node for node in collected("README.md", "docs/runtime.md") if node.startswith(("README.md::", "docs/"))]
    assert alone and len(alone) == len(set(alone))
    for args in (["tests/docs"], ["tests/docs", "README.md", "docs", "examples"], ["docs", "tests/docs"]):
        nodes = [node for node in collected(*args) if ".md::" in node]
        assert len(nodes) == len(set(nodes)), args  # no block twice
        for path in documents():
            name = str(path.relative_to(documents()[0].parent))
            blocks = list(SYBIL.parse(path).examples())
            assert any(node.startswith(f"{name}::") for node in nodes) or not blocks, (args, name)
        assert {node for node in nodes if node.startswith(("README.md::", "docs/runtime.md::"))} == set(alone), args


@pytest.mark.parametrize("required", [False, True], ids=["skips", "fails-under-PRORL_REQUIRE_BACKENDS"])
def test_a_missing_bubblewrap_or_vllm_env_skips_the_blocks_or_fails_them_where_backends_are_required(
    required, tmp_path, monkeypatch
):
    from prorl_adapter.dev import localstack

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    monkeypatch.setattr(localstack, "VLLM_PYTHON", tmp_path / "no-vllm-env" / "python")
    if required:
        monkeypatch.setenv("PRORL_REQUIRE_BACKENDS", "1")
    else:
        monkeypatch.delenv("PRORL_REQUIRE_BACKENDS", raising=False)
    outcome = pytest.fail.Exception if required else pytest.skip.Exception
    servers = DocServers(tmp_path)
    with pytest.raises(outcome, match="bubblewrap is not installed"):
        servers.sandbox_url()
    with pytest.raises(outcome, match="the vLLM environment is missing"):
        servers.llm_url()


def test_a_server_that_failed_to_start_fails_later_blocks_at_once_and_leaves_no_state_dir(tmp_path, monkeypatch):
    from prorl_adapter.dev import localstack

    starts = []

    def start_sandbox_runtime(state_dir, *args, **kwargs):
        starts.append(state_dir)
        raise RuntimeError("sandbox runtime did not answer /healthz within 600 s")

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    monkeypatch.setattr(localstack, "start_sandbox_runtime", start_sandbox_runtime)
    servers = DocServers(tmp_path)
    with pytest.raises(RuntimeError, match="did not answer"):
        servers.sandbox_url()
    with pytest.raises(pytest.fail.Exception, match="failed to start earlier in this run: RuntimeError: sandbox"):
        servers.sandbox_url()
    with pytest.raises(pytest.fail.Exception, match="failed to start earlier"):
        servers.rollout_url()  # needs the sandbox runtime: no second wait either
    [state_dir] = starts  # started once
    assert not state_dir.exists() and servers.state_dir is None


def fenced_blocks(path: Path, language: str) -> list[str]:
    """The text of each ```language block of the Markdown file `path`."""
    return [body for tag, body in FENCED.findall(path.read_text()) if tag == language]


def test_the_first_hour_shows_its_files_whole_as_they_are():
    """A newcomer copies the blocks: the plugin and the agent program shown are the files the tests run."""
    shown = fenced_blocks(FIRST_HOUR / "README.md", "python")
    for name in ("my_plugin.py", "my_agent.py"):
        assert (FIRST_HOUR / name).read_text() in shown, f"examples/first_hour/README.md does not show {name} whole"


def test_the_first_hour_starts_its_service_with_the_plugin_the_docs_tests_load():
    [serve] = [block for block in fenced_blocks(FIRST_HOUR / "README.md", "bash") if "prorl-rollout serve" in block]
    assert f"--plugin {FIRST_HOUR_PLUGIN}" in serve
