#!/usr/bin/env python3
"""What keeping every trajectory costs (`--record DIR`): CPU per trajectory and bytes per token, Parquet shards
(what the service writes, records.py) against JSON Lines (the format the issue named as the alternative), in the
same run.

    python bench/bench_records.py [--trajectories 2000] [--turns 8] [--tokens-per-turn 256] [--out docs/benchmarks.md]

The trajectories are made here (an agent episode's shape: a prompt, `--turns` turns of sampled tokens with
logprobs, tool output between them as context tokens, text and a tool call per turn); the token ids are drawn
from a 50,000-token vocabulary and logprobs from a spread like a sampled model's, so compression sees realistic
numbers. Measured: the process's CPU time (all threads: building rows on the caller's side and writing them on the
writer's) from the first record to the last file closed, per trajectory, and the bytes on disk per token (prompt
and response). The baseline is one JSON line per trajectory (`Trajectory.model_dump_json()`, the service's own
serialisation), written and flushed per line as a crash-safe JSON-lines log would be, uncompressed and with zstd
at the end (what rotation would compress). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from common import command_line, machine, replace_section, utc_now

from prorl_adapter.models import JobState, StageTimings, ToolCall, Trajectory, Turn
from prorl_adapter.service.records import Records

START, END = "<!-- bench_records:start -->", "<!-- bench_records:end -->"


def make_trajectory(rng: random.Random, n: int, turns: int, per_turn: int) -> Trajectory:
    prompt = [rng.randrange(50_000) for _ in range(300)]
    ids, mask, logprobs, made = [], [], [], []
    for index in range(turns):
        start = len(ids)
        ids += [rng.randrange(50_000) for _ in range(per_turn)]
        mask += [1] * per_turn
        logprobs += [-rng.expovariate(1.5) for _ in range(per_turn)]
        made.append(
            Turn(
                index=index,
                policy_version=n // 64,
                llm_server="http://127.0.0.1:8000",
                response_start=start,
                response_tokens=per_turn,
                finish_reason="stop",
                text="I will look at the files first. " * 8,
                tool_calls=[ToolCall(name="bash", arguments={"command": "ls -la src/ && cat README.md"})],
                observation="README.md  setup.py  src/ tests/\n" * 4,
                tool_results=["README.md  setup.py  src/ tests/\n" * 4],
            )
        )
        observation = [rng.randrange(50_000) for _ in range(per_turn // 2)]
        ids += observation
        mask += [0] * len(observation)
        logprobs += [0.0] * len(observation)
    return Trajectory(
        job_id=f"job-{n:08d}",
        task="swe",
        instance_id=f"repo__issue-{n % 500}",
        prompt_ids=prompt,
        response_ids=ids,
        response_mask=mask,
        response_logprobs=logprobs,
        turns=made,
        num_turns=turns,
        finish_reason="finish",
        reward=float(n % 2),
        reward_components={"outcome": float(n % 2), "step_cost": -0.01 * turns},
        policy_version_min=n // 64,
        policy_version_max=n // 64,
        timings=StageTimings(queued_s=0.1, init_s=0.5, run_s=30.0, eval_s=4.0, generate_s=20.0, tools_s=9.0),
        labels={"run": "bench"},
        group=f"g-{n // 8}",
        prompt_messages=[  # as the agent loop keeps them (schema 2): about the 300 prompt tokens' text
            {"role": "system", "content": "You are a software engineer working in a repository. " * 12},
            {"role": "user", "content": f"Fix issue {n % 500}: the parser drops the last line of a file. " * 4},
        ],
    )


def parquet(trajectories: list[Trajectory], directory: Path) -> tuple[float, int]:
    started = time.process_time()
    records = Records(directory, "bench")
    for t in trajectories:
        records.prorl_job_finished(t, JobState.done)
    records.close()
    return time.process_time() - started, sum(p.stat().st_size for p in directory.rglob("*.parquet"))


def json_lines(trajectories: list[Trajectory], path: Path) -> tuple[float, int, float, int]:
    started = time.process_time()
    with path.open("w") as out:
        for t in trajectories:
            out.write(t.model_dump_json() + "\n")
            out.flush()
    written = time.process_time() - started
    raw = path.stat().st_size
    started = time.process_time()
    compressed = pa.Codec("zstd", compression_level=3).compress(path.read_bytes())  # pyarrow's zstd, as Parquet's
    return written, raw, time.process_time() - started, len(compressed)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens-per-turn", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    trajectories = [make_trajectory(rng, n, args.turns, args.tokens_per_turn) for n in range(args.trajectories)]
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    with tempfile.TemporaryDirectory(prefix="bench-records-") as work:
        p_cpu, p_bytes = parquet(trajectories, Path(work) / "records")
        j_cpu, j_bytes, z_cpu, z_bytes = json_lines(trajectories, Path(work) / "trajectories.jsonl")
    n = len(trajectories)
    rows = [
        ("Parquet shards (records.py, zstd)", p_cpu, p_bytes),
        ("JSON Lines, flushed per line", j_cpu, j_bytes),
        ("JSON Lines, then zstd (level 3)", j_cpu + z_cpu, z_bytes),
    ]
    table = "\n".join(
        f"| {name} | {cpu / n * 1000:.2f} ms | {cpu / j_cpu:.2f}x | {size / tokens:.2f} | {size / j_bytes:.2f}x |"
        for name, cpu, size in rows
    )
    block = (
        f"{START}\n## Records: what keeping every trajectory costs — {utc_now()}\n\n"
        f"`{command_line(__file__, argv)}` on {machine()}.\n\n"
        f"{n:,} trajectories of {args.turns} turns x {args.tokens_per_turn} sampled tokens (and half as many tool "
        f"tokens after each, a 300-token prompt): {tokens / n:,.0f} tokens each, {tokens:,} in all.\n\n"
        "| format | CPU per trajectory | ÷ JSON Lines | bytes per token | ÷ JSON Lines |\n"
        "|---|---|---|---|---|\n" + table + "\n\n"
        "CPU is the process's, every thread (rows built as jobs finish, written on the writer's thread), from the "
        "first record to the last file closed. Parquet keeps the ids, masks, logprobs and per-token versions as "
        "typed columns, compressed; JSON Lines writes every number as text. Parquet is what `--record` writes: "
        "it is the smaller on disk and the readers RL teams use take it as it is; a JSON-lines log would lose less "
        "to a kill (a line, not a shard), which the shards' rotation by age (10 minutes) bounds instead.\n"
        f"{END}\n"
    )
    print(block)
    if args.out is not None:
        replace_section(args.out, START, END, block)


if __name__ == "__main__":
    main(sys.argv[1:])
