"""`prorl-rollout export` and `prorl-rollout import`: training data from a `--record` directory, and recorded or
exported trajectories put into a running service's experience buffer (docs/records.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from server_kit.cli import fail

from .export import (
    NO_ERROR,
    RL_SCHEMA,
    RecordFilter,
    Skipped,
    rl_rows,
    write_rows,
    write_sft,
)

PROG = "prorl-rollout"
IMPORT_CHUNK = 256  # trajectories per request at most: each request is put whole or not at all
MAX_REQUEST_BYTES = 8 << 20  # of JSON per request at most: under the service's body limit (16 MiB by default)


def add_records_parsers(sub: Any) -> None:
    export = sub.add_parser(
        "export",
        help="training data from a --record directory: chat-format SFT data or token-level RL data",
        description="Write the recorded trajectories that pass the filters as SFT conversations (.jsonl or "
        ".parquet) or as token-level RL rows (.parquet). Infrastructure failures (filter) are left out unless "
        "--include-filtered.",
    )
    export.add_argument("directory", type=Path, help="the service's --record directory")
    export.add_argument("--to", choices=("sft", "rl"), required=True, help="SFT conversations or RL token rows")
    export.add_argument("--out", type=Path, required=True, help="the file to write: .jsonl or .parquet (rl: .parquet)")
    export.add_argument("--since", type=moment, help="recorded at or after (ISO 8601; UTC unless it says)")
    export.add_argument("--until", type=moment, help="recorded before (ISO 8601)")
    export.add_argument("--task", action="append", default=[], help="only this task (repeat for several)")
    export.add_argument("--min-reward", type=float)
    export.add_argument("--max-reward", type=float)
    export.add_argument("--min-version", type=int, help="the oldest token's policy version at least this")
    export.add_argument("--max-version", type=int, help="the newest token's policy version at most this")
    export.add_argument("--label", action="append", default=[], type=label, help="KEY=VALUE (repeat: all must match)")
    export.add_argument(
        "--error-class", action="append", default=[], help=f"only this error class ({NO_ERROR}: no error); repeat"
    )
    export.add_argument("--state", action="append", default=[], choices=("done", "failed", "cancelled"))
    export.add_argument("--include-filtered", action="store_true", help="keep the episodes marked filter too")
    imports = sub.add_parser(
        "import",
        help="put recorded or exported trajectories into a running service's experience buffer",
        description="Send the trajectories of a --record directory, or of an `export --to rl` file, to "
        "POST /v1/trajectories, in requests of --chunk: each request is put whole or not at all.",
    )
    imports.add_argument("source", type=Path, help="a --record directory, or an RL export (.parquet)")
    imports.add_argument("--url", default="http://127.0.0.1:8766", help="the rollout service (default %(default)s)")
    imports.add_argument("--token", default=None, help="the service's API token (or PRORL_ROLLOUT_TOKEN)")
    imports.add_argument("--chunk", type=int, default=IMPORT_CHUNK, help="trajectories per request (%(default)s)")
    imports.add_argument("--group-whole", action="store_true", help="declare each group's size: refuse half groups")


def moment(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 time (2026-12-07T10:00:00)") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def run_export(args: argparse.Namespace) -> int:
    if not (args.directory / "trajectories").is_dir():
        return fail(PROG, f"{args.directory}: no trajectories/ in it: not a --record directory")
    if args.out.suffix not in (".jsonl", ".parquet") or (args.to == "rl" and args.out.suffix != ".parquet"):
        allowed = ".parquet" if args.to == "rl" else ".jsonl or .parquet"
        return fail(PROG, f"--out {args.out}: write {args.to} data to a {allowed} file")
    only = RecordFilter(
        since=args.since,
        until=args.until,
        tasks=frozenset(args.task),
        min_reward=args.min_reward,
        max_reward=args.max_reward,
        min_version=args.min_version,
        max_version=args.max_version,
        labels=dict(args.label),
        error_classes=frozenset(args.error_class),
        states=frozenset(args.state),
        include_filtered=args.include_filtered,
    )
    skipped = Skipped()
    try:
        if args.to == "sft":
            count = write_sft(args.out, args.directory, only, skipped)
        else:
            count = write_rows(args.out, rl_rows(args.directory, only), RL_SCHEMA)
    except (OSError, ValueError) as exc:
        return fail(PROG, f"export to {args.out} failed: {exc}")
    left = "".join(f"; left out {n}: {reason}" for reason, n in skipped.reasons.items())
    print(f"wrote {count} {'conversations' if args.to == 'sft' else 'rows'} to {args.out}{left}", file=sys.stderr)
    return 0


def run_import(args: argparse.Namespace) -> int:
    from ..trainer.client import SyncRolloutClient

    token = args.token or os.environ.get("PRORL_ROLLOUT_TOKEN")
    if not args.source.exists():
        return fail(PROG, f"{args.source}: no such --record directory or RL export file")
    done = 0
    with SyncRolloutClient(args.url, token=token, timeout=300.0) as client:
        try:
            for chunk in chunks(import_items(args.source), max(1, args.chunk), args.group_whole):
                sizes = group_sizes(chunk) if args.group_whole else None
                try:
                    done += client.import_trajectories(chunk, sizes).imported
                except Exception as exc:  # the service's 4xx/5xx, or no service: say which, and stop there
                    where = f"trajectories {done}-{done + len(chunk) - 1}"
                    return fail(PROG, f"{where} not imported ({done} were): {exc}")
        except (OSError, ValueError, KeyError) as exc:
            return fail(PROG, f"{args.source}: cannot read trajectories ({done} imported): {exc}")
    print(f"imported {done} trajectories into {args.url}", file=sys.stderr)
    return 0


def import_items(source: Path) -> Iterator[dict[str, Any]]:
    """The trajectories of a --record directory or of an RL export file, as POST /v1/trajectories takes them:
    one per token sequence (an episode's further segments as `JOB.k`), infrastructure failures left out."""
    rows = rl_rows(source, RecordFilter()) if source.is_dir() else iter(pq.read_table(source).to_pylist())
    for row in rows:
        if 1 not in row["response_mask"]:
            continue  # nothing the policy sampled: nothing to train on
        yield {
            "job_id": row["job_id"] if row["sequence"] == 0 else f"{row['job_id']}.{row['sequence']}",
            "task": row["data_source"],
            "prompt_ids": row["prompt_ids"],
            "response_ids": row["response_ids"],
            "response_mask": row["response_mask"],
            "response_logprobs": row["response_logprobs"],
            "token_versions": row["token_versions"],
            "reward": row["reward"],
            "reward_components": json.loads(row["reward_components"]),
            "group": row["group"],
            "labels": json.loads(row["labels"]),
        }


def chunks(
    items: Iterable[dict[str, Any]], size: int, whole_groups: bool, max_bytes: int = MAX_REQUEST_BYTES
) -> Iterator[list[dict[str, Any]]]:
    """`items` in requests of at most `size` trajectories and about `max_bytes` of JSON (under the service's body
    limit), read as they come. With `whole_groups`, a group is never split between two requests (a group larger
    than a request is one of its own), an item without a group is a group of its own, and the items are gathered
    by group first, in memory."""
    units: Iterable[list[dict[str, Any]]] = _by_group(items) if whole_groups else ([item] for item in items)
    chunk: list[dict[str, Any]] = []
    chunk_bytes = 0
    for unit in units:
        unit_bytes = sum(len(json.dumps(item)) for item in unit)
        if chunk and (len(chunk) + len(unit) > size or chunk_bytes + unit_bytes > max_bytes):
            yield chunk
            chunk, chunk_bytes = [], 0
        chunk += unit
        chunk_bytes += unit_bytes
    if chunk:
        yield chunk


def _by_group(items: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for item in items:
        item["group"] = item["group"] or item["job_id"]
        groups.setdefault(item["group"], []).append(item)
    yield from groups.values()


def group_sizes(items: list[dict[str, Any]]) -> dict[str, int]:
    return dict(Counter(item["group"] for item in items))
