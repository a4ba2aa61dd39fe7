"""How a policy turn's text becomes actions: the action formats of the built-in agent loop.

A model trained for tool use writes hermes `<tool_call>{json}</tool_call>` blocks, and its chat template lays
the tools out in the system prompt. A plain instruct model (SmolLM2's template knows nothing of tools) writes
text: asked to use a shell it answers with a fenced ```bash block, as text-based harnesses (SWE-agent and its
descendants) expect. Each format here says how the tools are offered and how a turn is read:

- `hermes`: the calls of today (`chat.parse_tool_calls`). The tools go to the chat template where it takes them;
  where it does not, `ChatTokenizer.render` describes them and the call syntax in the system message instead
  (for agent programs through the gateway too).
- `fenced`: the last fenced code block of a turn is its action, its language naming the tool (```bash, ```python,
  ```finish with the final answer). A tool can be written so when it takes exactly one required string
  argument; the tools and the rule are always described in the system prompt (no template lays out this format).
  A tool of several arguments (`str_replace_editor`) is not offered in it: the hermes format offers it.

The format is the job's (`JobRequest.action_format`) or else its task's (`TaskHandler.action_format`).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ..models import ActionFormatName, ToolCall
from ..tasks import Tool
from .chat import ChatTokenizer, ParsedCalls, parse_tool_calls


class ActionFormat(ABC):
    name: ClassVar[ActionFormatName]

    @abstractmethod
    def offer(
        self, chat: ChatTokenizer, system_prompt: str, tools: list[Tool]
    ) -> tuple[str, list[dict[str, Any]] | None]:
        """The system prompt and the tool schemas for the chat template (None: the template gets no tools)."""

    @abstractmethod
    def parse(self, text: str, tools: dict[str, Tool]) -> ParsedCalls:
        """The actions of one turn; what cannot be read becomes an error message for the agent, never an
        exception. No calls and no errors: the turn took no action (the episode ends, `no_tool_call`)."""


class HermesFormat(ActionFormat):
    name = "hermes"

    def offer(
        self, chat: ChatTokenizer, system_prompt: str, tools: list[Tool]
    ) -> tuple[str, list[dict[str, Any]] | None]:
        return system_prompt, [tool.schema() for tool in tools]  # a template without tools: ChatTokenizer.render

    def parse(self, text: str, tools: dict[str, Tool]) -> ParsedCalls:
        return parse_tool_calls(text)


# A fenced block as Markdown (CommonMark) writes one: the opening fence, three or more backticks and the
# language, starts a line; the closing fence stands on a line of its own and is at least as long. So backticks
# inside a line ("wrap code in ``` fences") or a shorter fence inside the block's text neither open nor close one.
_BLOCK = re.compile(r"^[ \t]*(`{3,})([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^[ \t]*\1`*[ \t]*$", re.DOTALL | re.MULTILINE)
_OPENING = re.compile(r"^[ \t]*`{3,}", re.MULTILINE)
# Other names models give the languages of the built-in tools' blocks.
ALIASES = {"sh": "bash", "shell": "bash", "console": "bash", "py": "python", "python3": "python"}


class FencedFormat(ActionFormat):
    name = "fenced"

    def offer(
        self, chat: ChatTokenizer, system_prompt: str, tools: list[Tool]
    ) -> tuple[str, list[dict[str, Any]] | None]:
        # A tool of several arguments cannot be a block: not offered (a block naming it is refused by `parse`).
        usable = [tool for tool in tools if _argument(tool) is not None]
        lines = [f"- ```{tool.name}: {tool.description} The block holds {_argument(tool)}." for tool in usable]
        example = usable[0].name if usable else "bash"
        return (
            f"{system_prompt}\n\n# Actions\n\nTo act, end your reply with one fenced code block whose language names "
            "the action; only the last block of a reply is run, and its output comes back to you. The actions:\n"
            + "\n".join(lines)
            + f"\n\nFor example:\n```{example}\n...\n```",
            None,
        )

    def parse(self, text: str, tools: dict[str, Tool]) -> ParsedCalls:
        blocks = list(_BLOCK.finditer(text))
        rest = text[blocks[-1].end() :] if blocks else text
        if _OPENING.search(rest):  # the last block is still open: the turn was cut, or the model never closed it
            return ParsedCalls([], ["a code block was opened with ``` but never closed"])
        if not blocks:
            return ParsedCalls([], [])
        _, language, body = blocks[-1].groups()
        name = ALIASES.get(language.lower(), language.lower())
        tool = tools.get(name)
        if tool is None:
            names = ", ".join(f"```{n}" for n in tools)
            shown = f"```{language}" if language else "a block with no language"
            return ParsedCalls([], [f"the last code block ({shown}) names no action; use one of {names}"])
        argument = _argument(tool)
        if argument is None:
            return ParsedCalls([], [f"{name} takes several arguments: it cannot be written as a code block"])
        return ParsedCalls([ToolCall(name=name, arguments={argument: body.rstrip("\n")})], [])


def _argument(tool: Tool) -> str | None:
    """The one required string argument a block's text fills, or None where the tool takes other arguments."""
    properties = tool.parameters.get("properties", {})
    required = tool.parameters.get("required", list(properties))
    if len(required) != 1 or properties.get(required[0], {}).get("type") != "string":
        return None
    return required[0]


FORMATS: dict[str, ActionFormat] = {f.name: f for f in (HermesFormat(), FencedFormat())}
