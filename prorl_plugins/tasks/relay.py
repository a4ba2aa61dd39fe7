"""`relay`: unpack a box with one command, then copy what was in it to where the checker looks with another.

Instance: {"word": "fix"}. The sandbox holds box.tar, and in it note.txt with the word; the episode succeeds
when answer.txt holds the word. It takes two turns in order, each acting on what the one before really did
in the sandbox: `cp note.txt answer.txt` fails until `tar -xf box.tar` has run.

With {"tool_latency_s": [2.1, 0.7]} the n-th bash call first sleeps the n-th latency in the sandbox: the
slow-tool workload of bench/bench_training.py, a stand-in for tools that take time as real ones do (test
suites, builds), with the task itself unchanged.

It is the built-in task that a tiny random model learns in minutes on CPU (the CPU trainer's demonstration),
so its action space is small and fixed: `relay_commands()` lists every command a turn may run, and
`relay_regex()` is the structured-output regex that makes each turn exactly one of them (`relay_turn_texts()`:
the turns' full texts). A random policy succeeds about once in sixteen episodes.

Left out on purpose, measured: a variant where the agent must read the word and write it with `echo <word>`
(the tool's output, not just its effect, decides the next turn) collapsed to writing one fixed word before it
learned to read, on this 2-layer random model within the minutes this demonstration has (docs/cpu-trainer.md).
"""

from __future__ import annotations

import math
import random
import shlex
from typing import Any

from prorl_adapter.service.chat import tool_call_regex, tool_call_texts
from prorl_adapter.tasks import EpisodeState, SandboxHandle, TaskConfigError, TaskHandler, Tool, bash_tool
from sandbox_runtime.client import SandboxAPIError

WORDS = ("fix", "log", "bug", "url")
BOX, NOTE, ANSWER = "box.tar", "note.txt", "answer.txt"
COMMANDS = (f"tar -xf {BOX}", f"cp {NOTE} {ANSWER}", "ls", f"rm {BOX}")
TURNS = 2  # what the CPU trainer gives an episode: the two commands, in order


def relay_commands() -> list[str]:
    return list(COMMANDS)


def relay_regex() -> str:
    return tool_call_regex("bash", "command", relay_commands())


def relay_turn_texts() -> list[str]:
    """The exact text of every turn `relay_regex` allows."""
    return tool_call_texts("bash", "command", relay_commands())


MAX_LATENCY_S = 60.0


def relay_instances(count: int, seed: int, tool_latency_median_s: float = 0.0) -> list[dict[str, Any]]:
    """`count` instances; with a latency median, each also gets a latency per turn, lognormal (sigma 0.5) about
    it and at most 4x it, drawn from `seed`."""
    rows = [{"id": f"relay-{seed}-{i}", "word": WORDS[(seed + i) % len(WORDS)]} for i in range(count)]
    if tool_latency_median_s > 0:
        rng = random.Random(seed)
        for row in rows:
            drawn = (rng.lognormvariate(math.log(tool_latency_median_s), 0.5) for _ in range(TURNS))
            row["tool_latency_s"] = [round(min(s, 4 * tool_latency_median_s), 3) for s in drawn]
    return rows


def tool_latencies(instance: dict[str, Any]) -> list[float]:
    """The instance's latency per call, each within [0, MAX_LATENCY_S]; a task config error where it is not a
    list of numbers."""
    latencies = instance.get("tool_latency_s", [])
    if not isinstance(latencies, list) or not all(
        isinstance(s, int | float) and not isinstance(s, bool) for s in latencies
    ):
        raise TaskConfigError("'tool_latency_s' must be a list of seconds, one per call")
    return [min(max(float(s), 0.0), MAX_LATENCY_S) for s in latencies]


def with_latency(tool: Tool, latencies: list[float]) -> Tool:
    """`tool`, its n-th call first sleeping `latencies[n]` seconds in the sandbox (none past the list's end)."""
    inner = tool.run

    async def run(env: SandboxHandle, args: dict[str, Any], state: EpisodeState) -> str:
        calls = len(state.commands)  # the bash tool records each command it runs
        if calls < len(latencies) and latencies[calls] > 0:
            await env.exec(f"sleep {latencies[calls]:.3f}", timeout=latencies[calls] + 10)
        return await inner(env, args, state)

    return Tool(tool.name, tool.description, tool.parameters, run)


class RelayTask(TaskHandler):
    name = "relay"
    tool_timeout_s = 10.0

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        latencies = tool_latencies(instance)
        bash = bash_tool(self.tool_timeout_s)
        return [with_latency(bash, latencies) if latencies else bash]

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return "You operate a Linux shell. Call the bash tool once per turn."

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return f"{BOX} holds {NOTE}. Put the word in it into {ANSWER}."

    async def init(self, env: SandboxHandle, instance: dict[str, Any]) -> None:
        word = instance.get("word")
        if not isinstance(word, str) or not word.isalnum():
            raise TaskConfigError("a relay instance needs 'word': letters and digits only")
        tool_latencies(instance)  # refused here, at set-up, rather than when its first tool call runs
        staging = f"/tmp/relay-{instance.get('id', 'box')}"
        script = (
            f"mkdir -p {shlex.quote(staging)} && printf '%s\\n' {shlex.quote(word)} > {shlex.quote(staging)}/{NOTE}"
            f" && tar -C {shlex.quote(staging)} -cf {BOX} {NOTE} && rm -rf {shlex.quote(staging)}"
        )
        result = await env.exec(script, timeout=10)
        if result.exit_code != 0:
            raise TaskConfigError(f"could not pack {BOX}: {result.output[-200:]}")

    async def evaluate(self, env: SandboxHandle, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        try:  # read by the runtime itself: a link planted as answer.txt is refused, not followed
            answer = (await env.read_file(ANSWER)).decode(errors="replace")
        except SandboxAPIError:
            return {"outcome": 0.0}
        return {"outcome": 1.0 if answer.strip() == instance["word"] else 0.0}
