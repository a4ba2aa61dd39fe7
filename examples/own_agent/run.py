"""Your own agent program through the rollout service, by one command:

    python examples/own_agent/run.py [--samples 4]      (or: make agent-demo)

It starts vLLM serving the tiny offline model, a bubblewrap sandbox runtime and the rollout service (each its
own process), then submits one shell-task instance with `num_samples` episodes (one GRPO group) whose run
stage is `agent.py` next to this file: the program runs inside each episode's sandbox on the `openai` client,
reaches the service's LLM gateway through the one port the runtime forwards, and is graded by the shell task.
It prints each trajectory: the reward, the calls, the token sequences and how many tokens the policy sampled.

The program's environment (the `openai` client, for the system's Python) is /opt/prorl-agent, made by
scripts/agent-env.sh. The tiny model has random weights, so its turns are constrained to bash tool calls by
vLLM's structured outputs: which command it runs is sampled.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prorl_adapter.dev import localstack
from prorl_adapter.models import AgentProgram, JobRequest, SamplingParams
from prorl_adapter.service.chat import tool_call_regex
from prorl_adapter.trainer.client import RolloutClient

AGENT_ENV = localstack.AGENT_ENV  # the runtime of the stack shows it to the sandboxes (--host-path)
COMMANDS = ["ls", "pwd", "echo hello > done.txt", "cat done.txt", "touch done.txt"]
console = Console()


def request(samples: int) -> JobRequest:
    agent = AgentProgram(
        command=f"{AGENT_ENV}/bin/python /tmp/agent/agent.py",
        # The program's code goes into the sandbox with the job: no image holds it here.
        files={"/tmp/agent/agent.py": Path(__file__).with_name("agent.py").read_text()},
        env={"XDG_CACHE_HOME": "/tmp/cache"},  # its client's caches stay out of the graded workspace
    )
    return JobRequest(
        task="shell",
        instance={"id": "hello", "goal": "Write the word hello into done.txt.", "check": "grep -qx hello done.txt"},
        sampling=SamplingParams(max_tokens=64, regex=tool_call_regex("bash", "command", COMMANDS)),
        max_turns=8,
        agent=agent,
        num_samples=samples,
    )


async def run(url: str, samples: int) -> None:
    async with RolloutClient(url) as client:
        trajectories = await client.run_samples(request(samples), wait=900)
    table = Table(title=f"{samples} episodes of one instance (group {trajectories[0].group!r})")
    for column in ("job", "reward", "calls", "sequences", "policy tokens", "context tokens", "commands"):
        table.add_column(column)
    for t in trajectories:
        if t.error is not None:
            table.add_row(t.job_id, "-", "-", "-", "-", "-", f"[red]{t.error.error_class}: {t.error.message}")
            continue
        sequences = t.all_segments()
        policy = sum(sum(s.response_mask) for s in sequences)
        context = sum(len(s.response_mask) - sum(s.response_mask) for s in sequences)
        commands = "; ".join(c.arguments.get("command", "") for turn in t.turns for c in turn.tool_calls)
        table.add_row(
            t.job_id, f"{t.reward:g}", str(t.num_turns), str(len(sequences)), str(policy), str(context), commands
        )
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    if not (AGENT_ENV / ".agent-installed").exists():
        console.print(f"[red]{AGENT_ENV} is missing: run scripts/agent-env.sh first (make agent-demo does)")
        return 2
    localstack.build_tiny_model()
    with tempfile.TemporaryDirectory(prefix="own-agent-") as workdir:
        console.print("starting vLLM (about a minute), the sandbox runtime and the rollout service ...")
        with localstack.local_stack(Path(workdir)) as (_, _, service):
            asyncio.run(run(service.url, args.samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
