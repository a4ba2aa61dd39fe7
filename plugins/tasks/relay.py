"""`relay`: read a word from a file with one command, then write it where the checker looks with another.

Instance: {"word": "red"}. The sandbox holds note.txt with the word; the episode succeeds when answer.txt
holds it. Two turns and a real tool result are needed: the word is only in the sandbox, never in the prompt.

It is the built-in task that a tiny random model learns in minutes on CPU (the CPU trainer's demonstration),
so its action space is small and fixed: `relay_commands(words)` lists every command a turn may run, and
`relay_regex(words)` is the structured-output regex that makes each turn exactly one of them
(`relay_turn_texts(words)`: the turns' full texts). A policy that
ignores the tool result can at best write a fixed word (reward 1/len(words)); above that, it reads the note.
"""

from __future__ import annotations

import random
import shlex
from typing import Any

from prorl_adapter.chat import tool_call_regex, tool_call_texts
from prorl_adapter.tasks import Environment, EpisodeState, TaskConfigError, TaskHandler, Tool, bash_tool

WORDS = ("red", "green", "blue", "gold")
NOTE = "note.txt"
ANSWER = "answer.txt"


def relay_commands(words: tuple[str, ...] | list[str] = WORDS) -> list[str]:
    return [f"cat {NOTE}", *(f"echo {word} > {ANSWER}" for word in words)]


def relay_regex(words: tuple[str, ...] | list[str] = WORDS) -> str:
    return tool_call_regex("bash", "command", relay_commands(words))


def relay_turn_texts(words: tuple[str, ...] | list[str] = WORDS) -> list[str]:
    """The exact text of every turn `relay_regex` allows."""
    return tool_call_texts("bash", "command", relay_commands(words))


def relay_instances(count: int, seed: int, words: tuple[str, ...] | list[str] = WORDS) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"id": f"relay-{seed}-{i}", "word": rng.choice(list(words))} for i in range(count)]


class RelayTask(TaskHandler):
    name = "relay"
    tool_timeout_s = 10.0

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        return [bash_tool(self.tool_timeout_s)]

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return "You operate a Linux shell. Call the bash tool once per turn inside <tool_call></tool_call>."

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return f"{NOTE} holds a word. Write that word into {ANSWER}."

    async def init(self, env: Environment, instance: dict[str, Any]) -> None:
        word = instance.get("word")
        if not isinstance(word, str) or not word.isalnum():
            raise TaskConfigError("a relay instance needs 'word': letters and digits only")
        result = await env.exec(f"printf '%s\\n' {shlex.quote(word)} > {NOTE}", timeout=10)
        if result.exit_code != 0:
            raise TaskConfigError(f"could not write {NOTE}: {result.output[-200:]}")

    async def evaluate(self, env: Environment, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        result = await env.exec(f"cat {ANSWER} 2>/dev/null", timeout=10)
        return {"outcome": 1.0 if result.output.strip() == instance["word"] else 0.0}
