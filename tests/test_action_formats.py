"""The action formats of the built-in agent loop: how a turn's text becomes tool calls, and how tools are offered
to a model whose chat template does or does not lay them out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.service.actions import FORMATS
from prorl_adapter.service.chat import with_tools_in_text
from prorl_adapter.tasks import FINISH, Tool, bash_tool, python_tool

TOOLS = {tool.name: tool for tool in (bash_tool(5), python_tool(5), FINISH)}
fenced = FORMATS["fenced"]
hermes = FORMATS["hermes"]


@pytest.mark.parametrize(
    ("text", "name", "arguments"),
    [
        ("Let me look.\n```bash\nls -la\n```\n", "bash", {"command": "ls -la"}),
        ("```sh\necho hi\n```", "bash", {"command": "echo hi"}),
        ("```python\nprint(2 + 3)\n```", "python", {"code": "print(2 + 3)"}),
        ("```py\nprint(1)\n```", "python", {"code": "print(1)"}),
        ("The answer is 5.\n```finish\n5\n```", "finish", {"answer": "5"}),
        # the last block is the action, whatever came before it
        ("```bash\nrm -rf /\n```\nNo, rather:\n```bash\npwd\n```", "bash", {"command": "pwd"}),
        # a block inside a block's text is its text: the closing fence must start a line
        ("```bash\necho '```'\n```", "bash", {"command": "echo '```'"}),
        ("```bash\nfor i in 1 2; do\n  echo $i\ndone\n```", "bash", {"command": "for i in 1 2; do\n  echo $i\ndone"}),
        # backticks inside a line open nothing
        ("Wrap code in ``` fences.\n```bash\nls\n```", "bash", {"command": "ls"}),
        # a shorter fence inside a longer one is the block's text, as in Markdown
        ("````bash\ncat <<'EOF'\n```py\nx\n```\nEOF\n````", "bash", {"command": "cat <<'EOF'\n```py\nx\n```\nEOF"}),
        # an indented fence, and a closing fence with trailing spaces
        ("  ```python\nprint(1)\n  ```  \nDone.", "python", {"code": "print(1)"}),
    ],
)
def test_the_last_fenced_block_is_the_action(text, name, arguments):
    parsed = fenced.parse(text, TOOLS)
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.calls] == [(name, arguments)]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("```bash\nls", "never closed"),
        ("```bash\nls\n```\nAnd then:\n```bash\npwd", "never closed"),
        ("```ruby\nputs 1\n```", "```ruby"),
        ("```\nls\n```", "no language"),
    ],
)
def test_an_unreadable_block_is_a_format_error_for_the_agent(text, fragment):
    parsed = fenced.parse(text, TOOLS)
    assert parsed.calls == [] and len(parsed.errors) == 1 and fragment in parsed.errors[0]


def test_prose_without_a_block_takes_no_action():
    parsed = fenced.parse("I would run ls to see the files.", TOOLS)
    assert parsed.calls == [] and parsed.errors == []


def test_a_tool_of_several_arguments_cannot_be_a_block():
    edit = Tool(
        "edit",
        "Replace text in a file.",
        {"type": "object", "properties": {"path": {"type": "string"}, "new": {"type": "string"}}},
        None,
    )
    parsed = fenced.parse("```edit\nx\n```", {"edit": edit})
    assert parsed.calls == [] and "several arguments" in parsed.errors[0]


def test_hermes_offers_the_tools_to_the_chat_template():
    system, schemas = hermes.offer(SimpleNamespace(takes_tools=False), "Be brief.", list(TOOLS.values()))
    assert system == "Be brief." and [s["function"]["name"] for s in schemas] == ["bash", "python", "finish"]


SCHEMAS = [tool.schema() for tool in TOOLS.values()]


def test_for_a_template_without_tools_the_tools_and_calls_are_written_as_text():
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List."},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "content": "a.txt"},
    ]
    out = with_tools_in_text(messages, SCHEMAS)
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and "<tool_call>" in out[0]["content"]
    assert all(f'"name": "{name}"' in out[0]["content"] for name in TOOLS)
    assert "tool_calls" not in out[2]
    assert out[2]["content"] == 'Looking.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    assert out[1:2] + out[3:] == messages[1:2] + messages[3:] and "tool_calls" in messages[2]  # a copy
    # No system message: one is put first, holding the tools.
    alone = with_tools_in_text(messages[1:2], SCHEMAS)
    assert alone[0]["role"] == "system" and alone[0]["content"].startswith("# Tools") and alone[1] == messages[1]


def test_fenced_describes_every_action_in_the_system_prompt():
    system, schemas = fenced.offer(SimpleNamespace(takes_tools=True), "Be brief.", list(TOOLS.values()))
    assert schemas is None
    assert all(f"```{name}" in system for name in TOOLS)


def test_a_job_chooses_its_format_and_an_unknown_one_is_refused():
    assert JobRequest(task="shell", action_format="fenced").action_format == "fenced"
    assert JobRequest(task="shell").action_format is None
    with pytest.raises(ValueError, match="action_format"):
        JobRequest(task="shell", action_format="xml")
