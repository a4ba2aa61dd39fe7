"""`relay`: unpack a box with one command, then copy what was in it to where the checker looks with another.

Instance: {"word": "fix"}. The sandbox holds box.tar, and in it note.txt with the word; the episode succeeds
when answer.txt holds the word. It takes two turns in order, each acting on what the one before really did
in the sandbox: `cp note.txt answer.txt` fails until `tar -xf box.tar` has run.

It is the built-in task that a tiny random model learns in minutes on CPU (the CPU trainer's demonstration),
so its action space is small and fixed: `relay_commands()` lists every command a turn may run, and
`relay_regex()` is the structured-output regex that makes each turn exactly one of them (`relay_turn_texts()`:
the turns' full texts). A random policy succeeds about once in sixteen episodes.

Left out on purpose, measured: a variant where the agent must read the word and write it with `echo <word>`
(the tool's output, not just its effect, decides the next turn) collapsed to writing one fixed word before it
learned to read, on this 2-layer random model within the minutes this demonstration has (docs/cpu-trainer.md).
"""

from __future__ import annotations

import shlex
from typing import Any

from prorl_adapter.service.chat import tool_call_regex, tool_call_texts
from prorl_adapter.tasks import Environment, EpisodeState, TaskConfigError, TaskHandler, Tool, bash_tool
from sandbox_runtime.client import SandboxAPIError

WORDS = ("fix", "log", "bug", "url")
BOX, NOTE, ANSWER = "box.tar", "note.txt", "answer.txt"
COMMANDS = (f"tar -xf {BOX}", f"cp {NOTE} {ANSWER}", "ls", f"rm {BOX}")


def relay_commands() -> list[str]:
    return list(COMMANDS)


def relay_regex() -> str:
    return tool_call_regex("bash", "command", relay_commands())


def relay_turn_texts() -> list[str]:
    """The exact text of every turn `relay_regex` allows."""
    return tool_call_texts("bash", "command", relay_commands())


def relay_instances(count: int, seed: int) -> list[dict[str, Any]]:
    return [{"id": f"relay-{seed}-{i}", "word": WORDS[(seed + i) % len(WORDS)]} for i in range(count)]


class RelayTask(TaskHandler):
    name = "relay"
    tool_timeout_s = 10.0

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        return [bash_tool(self.tool_timeout_s)]

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return "You operate a Linux shell. Call the bash tool once per turn inside <tool_call></tool_call>."

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return f"{BOX} holds {NOTE}. Put the word in it into {ANSWER}."

    async def init(self, env: Environment, instance: dict[str, Any]) -> None:
        word = instance.get("word")
        if not isinstance(word, str) or not word.isalnum():
            raise TaskConfigError("a relay instance needs 'word': letters and digits only")
        staging = f"/tmp/relay-{instance.get('id', 'box')}"
        script = (
            f"mkdir -p {shlex.quote(staging)} && printf '%s\\n' {shlex.quote(word)} > {shlex.quote(staging)}/{NOTE}"
            f" && tar -C {shlex.quote(staging)} -cf {BOX} {NOTE} && rm -rf {shlex.quote(staging)}"
        )
        result = await env.exec(script, timeout=10)
        if result.exit_code != 0:
            raise TaskConfigError(f"could not pack {BOX}: {result.output[-200:]}")

    async def evaluate(self, env: Environment, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        try:  # read by the runtime itself: a link planted as answer.txt is refused, not followed
            answer = (await env.read_file(ANSWER)).decode(errors="replace")
        except SandboxAPIError:
            return {"outcome": 0.0}
        return {"outcome": 1.0 if answer.strip() == instance["word"] else 0.0}
