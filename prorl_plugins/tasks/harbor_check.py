"""`prorl-harbor check`: every task of a Harbor dataset scores 1 with its oracle and 0 untouched, before a training
run spends GPU hours on a broken one.

    prorl-harbor check DATASET --sandbox-url URL [--sandbox-token T] [--image-template harbor/{name}] [--jobs 4]
    python -m prorl_plugins.tasks.harbor_check check DATASET --sandbox-url URL

DATASET is a Harbor task directory or a directory of them. For each task, in a fresh sandbox of the task's image on
the sandbox runtime at URL: solution/solve.sh runs (the oracle), every process it left is ended, and the verifier
runs as the `harbor` task's eval runs it (harbor.run_verifier): the task's reward must be 1 (the component
`outcome`: reward.txt's number, reward.json's `reward` entry, as Harbor's own oracle run reads them). Then, in
another fresh sandbox, the verifier alone: the reward must be 0 (a task whose untouched sandbox passes rewards doing
nothing). A task without solution/solve.sh is checked untouched only. Prints one line per task and a table; the
exit status is 1 when any task is broken, 2 for a command line or a runtime that cannot be used.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prorl_adapter.tasks import Environment, TaskConfigError
from sandbox_runtime.client import SandboxAPIError, SandboxClient
from server_kit.cli import OneLineParser, fail

from .harbor import HarborTask, run_solution, run_verifier
from .harbor_format import HarborTaskDir, dataset_tasks

PROG = "prorl-harbor"


@dataclass(frozen=True)
class Checked:
    """One task's check: its rewards with the oracle and untouched (None: not run), and what is wrong."""

    task: str
    solved: float | None
    untouched: float | None
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


async def check_task(client: SandboxClient, url: str, handler: HarborTask, instance: dict, name: str) -> Checked:
    """The oracle's reward and the untouched reward of one task, each in a fresh sandbox."""
    problems: list[str] = []
    try:
        task = handler.task(instance)
    except TaskConfigError as exc:
        return Checked(name, None, None, (str(exc),))
    solved = None
    if task.has_solution:
        solved = await _episode(client, url, handler, instance, task, oracle=True, problems=problems)
        if solved is not None and solved != 1.0:
            problems.append(f"the oracle (solution/solve.sh) scores {solved:g}, not 1")
    untouched = await _episode(client, url, handler, instance, task, oracle=False, problems=problems)
    if untouched is not None and untouched != 0.0:
        problems.append(f"the untouched sandbox scores {untouched:g}, not 0")
    return Checked(name, solved, untouched, tuple(problems))


async def _episode(
    client: SandboxClient,
    url: str,
    handler: HarborTask,
    instance: dict,
    task: HarborTaskDir,
    *,
    oracle: bool,
    problems: list[str],
) -> float | None:
    what = "with the oracle" if oracle else "untouched"
    try:
        spec = handler.checked_spec(instance)
        info = await client.create_sandbox(**spec, labels={"harbor_check": task.name})
    except (TaskConfigError, SandboxAPIError, ValueError) as exc:
        problems.append(f"no sandbox {what}: {exc}")
        return None
    env = Environment(client, info.id, url, spec["workdir"])
    try:
        await handler.init(env.for_task(), instance)
        if oracle:
            result = await run_solution(env.for_task(), task)
            if result.status != "completed" or result.exit_code != 0:
                ended = f"{result.status}, exit {result.exit_code}"
                problems.append(f"solution/solve.sh ended {ended}: {result.output[-300:]}")
        await env.end_processes()  # as the pipeline does before every eval
        verdict = await run_verifier(env.for_task(), task)
        if "verifier_error" in verdict.artifacts:
            error, log = verdict.artifacts["verifier_error"], verdict.artifacts["verifier_log"][-300:]
            problems.append(f"{what}: {error}: {log}")
        return verdict.components["outcome"]
    except (TaskConfigError, SandboxAPIError) as exc:
        problems.append(f"{what}: {exc}")
        return None
    finally:
        with contextlib.suppress(SandboxAPIError):
            await client.delete_sandbox(info.id)


async def check_dataset(
    dataset: Path, url: str, token: str | None, image_template: str | None, jobs: int
) -> list[Checked]:
    tasks = dataset_tasks(dataset)
    handler = HarborTask(datasets=[dataset.resolve()], image_template=image_template)
    limit = asyncio.Semaphore(jobs)
    async with SandboxClient(url, token=token, timeout=900) as client:

        async def one(path: Path) -> Checked:
            async with limit:
                checked = await check_task(client, url, handler, {"path": str(path)}, path.name)
            print(f"{'ok    ' if checked.ok else 'BROKEN'} {checked.task}", file=sys.stderr, flush=True)
            return checked

        return list(await asyncio.gather(*(one(path) for path in tasks)))


def table(results: Sequence[Checked]) -> str:
    def reward(value: float | None) -> str:
        return "-" if value is None else f"{value:g}"

    width = max([len("task"), *(len(checked.task) for checked in results)])
    lines = [f"{'task':<{width}}  oracle  untouched  verdict"]
    for checked in results:
        verdict = "ok" if checked.ok else "BROKEN: " + "; ".join(checked.problems)
        lines.append(f"{checked.task:<{width}}  {reward(checked.solved):<6}  {reward(checked.untouched):<9}  {verdict}")
    broken = sum(not checked.ok for checked in results)
    lines.append(f"{len(results)} tasks, {broken} broken")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog=PROG, description="Harbor tasks: check a dataset's tasks before training on them")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="each task scores 1 with solution/solve.sh and 0 untouched")
    check.add_argument("dataset", type=Path, help="a Harbor task directory, or a directory of them")
    check.add_argument("--sandbox-url", required=True, help="the sandbox runtime that has the tasks' images")
    check.add_argument(
        "--sandbox-token", default=os.environ.get("PRORL_SANDBOX_TOKEN"), help="its token (env PRORL_SANDBOX_TOKEN)"
    )
    check.add_argument(
        "--image-template",
        default=None,
        help="image names from task names (default: env PRORL_HARBOR_IMAGE_TEMPLATE, else harbor/{name})",
    )
    check.add_argument("--jobs", type=int, default=4, help="tasks checked at once (default 4)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        return fail(PROG, "--jobs must be at least 1")
    try:
        results = asyncio.run(
            check_dataset(args.dataset, args.sandbox_url, args.sandbox_token, args.image_template, args.jobs)
        )
    except TaskConfigError as exc:
        return fail(PROG, str(exc))
    except SandboxAPIError as exc:
        return fail(PROG, f"the sandbox runtime at {args.sandbox_url}: {exc}")
    print(table(results))
    return 0 if all(checked.ok for checked in results) else 1


if __name__ == "__main__":
    sys.exit(main())
