"""Durable records of every finished trajectory, failures included, and of every LLM gateway call: append-only
Parquet shards (`--record DIR`, docs/records.md).

A finished trajectory lives in the service for `--result-ttl-s`; its record stays. Layout:
`DIR/trajectories/` and `DIR/gateway_calls/`, each `<UTC start>-<replica>-<writer>-<n>.parquet` shards. The shard
being written is named `.NAME.parquet.open` until it is closed (at `shard_bytes`, at `shard_age_s`, or when the
service stops) and then renamed `NAME.parquet`: a reader of the directory (pyarrow, pandas, DuckDB skip hidden
files) never takes a half-written file for a shard, a closed shard is never written again, and a killed service
loses at most the shard it was writing (Parquet writes its footer at close, so an `.open` file cannot be read;
`read_rows` says it skipped it).

Why Parquet: token ids, masks, logprobs and per-token versions are columns of numbers, which Parquet stores
several times smaller than JSON text and which pandas, DuckDB, verl's and SkyRL's data loaders read as they are.
The columns a team filters by (task, reward, version, group, labels, error class, stage timings) are columns of
their own; turns and segments (nested, read with the trajectory) are JSON text. `RECORD_SCHEMA` is in every row:
a reader of a later version knows what it reads.

Each stream is written on a thread of its own, off the event loop: recording only queues the row.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from server_kit.cli import StartupError

from ..hooks.specs import hookimpl
from ..models import BudgetCut, JobError, JobState, Segment, StageTimings, ToolCall, Trajectory, Turn
from .token_history import Call, Sampled

log = logging.getLogger(__name__)

# 3: the budget that cut an episode (`cut_json`) and whether an LLM outage failed it (`error_outage`); 2: the
# prompt's chat messages and tools, each call's messages and reply (1: without them). Earlier rows read with nulls.
RECORD_SCHEMA = 3
SHARD_BYTES = 64 * 1024 * 1024
SHARD_AGE_S = 600.0
FLUSH_ROWS = 256  # rows per Parquet row group, at most
FLUSH_S = 5.0  # a row waits at most this long to be written (a row group of fewer rows then)
OPEN_PREFIX = "."  # a shard being written is hidden: Parquet readers of a directory (pyarrow, pandas) skip it
OPEN_SUFFIX = ".open"
_NOTHING = object()  # the writer's wake-up at a deadline, without a row
# A gateway call as chat: its messages, its tools (None: none) and its answer as an assistant message.
Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int16()),
        ("recorded_at", pa.timestamp("ms", tz="UTC")),
        ("replica", pa.string()),
        ("job_id", pa.string()),
        ("task", pa.string()),
        ("instance_id", pa.string()),
        ("group", pa.string()),
        ("attempt", pa.int32()),
        ("retry_of", pa.string()),
        ("labels", pa.map_(pa.string(), pa.string())),
        ("state", pa.string()),
        ("finish_reason", pa.string()),
        ("error_class", pa.string()),
        ("error_message", pa.string()),
        ("error_outage", pa.bool_()),
        ("cut_json", pa.string()),
        ("filter", pa.bool_()),
        ("reward", pa.float64()),
        ("reward_components", pa.map_(pa.string(), pa.float64())),
        ("policy_version_min", pa.int64()),
        ("policy_version_max", pa.int64()),
        ("num_turns", pa.int32()),
        ("timings", pa.struct([(name, pa.float64()) for name in StageTimings.model_fields])),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("response_mask", pa.list_(pa.int8())),
        ("response_logprobs", pa.list_(pa.float64())),
        ("token_versions", pa.list_(pa.int64())),  # per response token; null on tool and template tokens
        ("turns_json", pa.string()),
        ("segments_json", pa.string()),
        ("artifacts", pa.map_(pa.string(), pa.string())),
        ("prompt_messages_json", pa.string()),  # the chat messages of prompt_ids (the built-in agent loop's)
        ("prompt_tools_json", pa.string()),
    ]
)


def trajectory_row(trajectory: Trajectory, state: JobState, replica: str, recorded_at: float) -> dict[str, Any]:
    t = trajectory
    return {
        "schema_version": RECORD_SCHEMA,
        "recorded_at": datetime.fromtimestamp(recorded_at, UTC),
        "replica": replica,
        "job_id": t.job_id,
        "task": t.task,
        "instance_id": t.instance_id,
        "group": t.group,
        "attempt": t.attempt,
        "retry_of": t.retry_of,
        "labels": list(t.labels.items()),
        "state": state.value,
        "finish_reason": t.finish_reason,
        "error_class": t.error.error_class if t.error else None,
        "error_message": t.error.message if t.error else None,
        "error_outage": t.error.outage if t.error else None,
        "cut_json": t.cut.model_dump_json() if t.cut else None,
        "filter": t.filter,
        "reward": t.reward,
        "reward_components": list(t.reward_components.items()),
        "policy_version_min": t.policy_version_min,
        "policy_version_max": t.policy_version_max,
        "num_turns": t.num_turns,
        "timings": t.timings.model_dump(),
        "prompt_ids": t.prompt_ids,
        "response_ids": t.response_ids,
        "response_mask": t.response_mask,
        "response_logprobs": t.response_logprobs,
        "token_versions": t.token_versions(),
        "turns_json": json.dumps([turn.model_dump(mode="json") for turn in t.turns]),
        "segments_json": json.dumps([segment.model_dump(mode="json") for segment in t.segments]),
        "artifacts": list(t.artifacts.items()),
        "prompt_messages_json": json.dumps(t.prompt_messages),
        "prompt_tools_json": json.dumps(t.prompt_tools),
    }


def row_trajectory(row: dict[str, Any]) -> Trajectory:
    """The trajectory a record's row (as `read_rows` gives it) holds, as the service delivered
    it."""
    error = None
    if row["error_class"]:
        error = JobError(error_class=row["error_class"], message=row["error_message"], outage=bool(row["error_outage"]))
    return Trajectory(
        job_id=row["job_id"],
        task=row["task"],
        instance_id=row["instance_id"],
        prompt_ids=row["prompt_ids"],
        response_ids=row["response_ids"],
        response_mask=row["response_mask"],
        response_logprobs=row["response_logprobs"],
        turns=[Turn.model_validate(turn) for turn in json.loads(row["turns_json"])],
        num_turns=row["num_turns"],
        finish_reason=row["finish_reason"],
        reward=row["reward"],
        reward_components=dict(row["reward_components"]),
        policy_version_min=row["policy_version_min"],
        policy_version_max=row["policy_version_max"],
        timings=StageTimings(**row["timings"]),
        error=error,
        filter=row["filter"],
        labels=dict(row["labels"]),
        group=row["group"],
        attempt=row["attempt"],
        retry_of=row["retry_of"],
        artifacts=dict(row["artifacts"]),
        segments=[Segment.model_validate(s) for s in json.loads(row["segments_json"])],
        prompt_messages=json.loads(row["prompt_messages_json"] or "[]"),
        prompt_tools=json.loads(row["prompt_tools_json"] or "null"),
        cut=BudgetCut.model_validate_json(row["cut_json"]) if row["cut_json"] else None,
    )


CALL_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int16()),
        ("recorded_at", pa.timestamp("ms", tz="UTC")),
        ("replica", pa.string()),
        ("job_id", pa.string()),
        ("episode", pa.string()),  # one run of the job's agent program (a job started again has another)
        ("call", pa.int32()),  # its index among the episode's recorded calls; null where it was not recorded
        ("protocol", pa.string()),  # chat, completions, responses, messages
        ("in_episode_log", pa.bool_()),  # False: answered after its episode's run ended, so in no trajectory
        ("segment", pa.int32()),
        ("policy_version", pa.int64()),
        ("token_versions", pa.list_(pa.int64())),
        ("llm_server", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("response_logprobs", pa.list_(pa.float64())),
        ("text", pa.string()),
        ("tool_calls_json", pa.string()),
        ("tool_call_errors", pa.list_(pa.string())),
        ("generate_s", pa.float64()),
        # The call as chat messages (every protocol's is translated to them), its tools and the answer as an
        # assistant message; null for a completions call (a prompt of text).
        ("messages_json", pa.string()),
        ("tools_json", pa.string()),
        ("reply_json", pa.string()),
    ]
)


def call_row(
    job_id: str,
    episode: str,
    protocol: str,
    sampled: Sampled,
    recorded: tuple[int, Call] | None,
    parsed: tuple[list[ToolCall], list[str]],
    conversation: Conversation | None,
    replica: str,
    recorded_at: float,
) -> dict[str, Any]:
    """A gateway call's row: `recorded` is its index among the episode's calls and the episode's record of it
    (None: the episode's run had ended, so it is in no trajectory); `parsed` its tool calls and their errors;
    `conversation` its chat messages, tools and reply (None for a completions call)."""
    index, call = recorded if recorded else (None, None)
    messages, tools, reply = conversation if conversation else (None, None, None)
    tool_calls, errors = parsed
    starts = [(0, sampled.policy_version)] + [(r.offset, r.policy_version) for r in sampled.resumptions]
    ends = [offset for offset, _ in starts[1:]] + [len(sampled.response_ids)]
    versions = [version for (offset, version), end in zip(starts, ends, strict=True) for _ in range(end - offset)]
    return {
        "schema_version": RECORD_SCHEMA,
        "recorded_at": datetime.fromtimestamp(recorded_at, UTC),
        "replica": replica,
        "job_id": job_id,
        "episode": episode,
        "call": index,
        "protocol": protocol,
        "in_episode_log": call is not None,
        "segment": call.segment if call else None,
        "policy_version": sampled.policy_version,
        "token_versions": versions,
        "llm_server": sampled.server,
        "finish_reason": sampled.finish_reason,
        "prompt_ids": sampled.prompt_ids,
        "response_ids": sampled.response_ids,
        "response_logprobs": sampled.response_logprobs,
        "text": sampled.text,
        "tool_calls_json": json.dumps([c.model_dump() for c in tool_calls]),
        "tool_call_errors": errors,
        "generate_s": sampled.generate_s,
        "messages_json": None if messages is None else json.dumps(messages),
        "tools_json": None if messages is None else json.dumps(tools),
        "reply_json": None if reply is None else json.dumps(reply),
    }


def read_rows(
    directory: Path, stream: str = "trajectories", columns: list[str] | None = None
) -> Iterator[dict[str, Any]]:
    """Every row of `stream` under `directory` (a `--record` directory), shard by shard in the order they were
    begun, with `columns` only if given (of the stream's schema); a shard still `.open` (being written, or left
    by a killed service) is skipped with a warning. Rows of an earlier schema version read with the columns it
    lacked as null; a later one is refused."""
    shards = directory / stream
    schema = TRAJECTORY_SCHEMA if stream == "trajectories" else CALL_SCHEMA
    if columns is not None:
        schema = pa.schema([schema.field(name) for name in ["schema_version", *columns]])
    for path in sorted(shards.glob(f"{OPEN_PREFIX}*.parquet{OPEN_SUFFIX}")):
        log.warning("%s: not closed (being written, or its service was killed): skipped", path)
    for path in sorted(p for p in shards.glob("*.parquet") if not p.name.startswith(OPEN_PREFIX)):
        shard = pq.ParquetFile(path)
        present = [name for name in schema.names if name in shard.schema_arrow.names]
        for batch in shard.iter_batches(columns=present):
            for row in batch.to_pylist():
                yield current_row(row, schema, path)


def current_row(row: dict[str, Any], schema: pa.Schema, path: Path) -> dict[str, Any]:
    """A row read from the shard `path`, with every column of `schema` (of this RECORD_SCHEMA): a row of an earlier
    version has the columns it lacked as null; one of a later version is refused (ValueError)."""
    if row["schema_version"] > RECORD_SCHEMA:
        raise ValueError(f"{path}: record schema {row['schema_version']} is newer than {RECORD_SCHEMA}")
    return {column: row.get(column) for column in schema.names}


def read_trajectories(directory: Path) -> Iterator[Trajectory]:
    for row in read_rows(directory):
        yield row_trajectory(row)


class Records:
    """The service's records (`--record DIR`): a plugin that keeps every finished job's trajectory
    (`prorl_job_finished`), and the gateway's recorder of every answered call (`call`)."""

    def __init__(self, directory: Path, replica: str, **shards: Any) -> None:
        """StartupError, naming --record, for a directory this user cannot make or write in."""
        self.replica = replica
        try:
            self.trajectories = ShardWriter(directory / "trajectories", TRAJECTORY_SCHEMA, replica, **shards)
            self.calls = ShardWriter(directory / "gateway_calls", CALL_SCHEMA, replica, **shards)
        except OSError as exc:
            raise StartupError(
                f"--record {directory}: cannot write records in {exc.filename} ({exc.strerror}); give --record a "
                "directory this user can create and write"
            ) from None

    @hookimpl
    def prorl_job_finished(self, trajectory: Trajectory, state: JobState) -> None:
        now = time.time()
        self.trajectories.put(lambda: trajectory_row(trajectory, state, self.replica, now))

    def call(
        self,
        job_id: str,
        episode: str,
        protocol: str,
        sampled: Sampled,
        recorded: tuple[int, Call] | None,
        parsed: tuple[list[ToolCall], list[str]],
        conversation: Conversation | None = None,
    ) -> None:
        now = time.time()
        self.calls.put(
            lambda: call_row(job_id, episode, protocol, sampled, recorded, parsed, conversation, self.replica, now)
        )

    def close(self) -> None:
        """Write what is queued and close the shards (blocking: call it off the event loop)."""
        self.trajectories.close()
        self.calls.close()


class ShardWriter:
    """One stream of rows: queued by any thread, written as shards of `schema` by a thread of its own."""

    def __init__(
        self,
        directory: Path,
        schema: pa.Schema,
        replica: str,
        shard_bytes: int = SHARD_BYTES,
        shard_age_s: float = SHARD_AGE_S,
        flush_rows: int = FLUSH_ROWS,
        flush_s: float = FLUSH_S,
    ) -> None:
        self.directory, self.schema, self.replica = directory, schema, replica
        # Here, at start-up: a directory it cannot make, or write in, fails it (not its first shard, minutes later).
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=self.directory):
            pass
        self.shard_bytes, self.shard_age_s = shard_bytes, shard_age_s
        self.flush_rows, self.flush_s = flush_rows, flush_s
        self.recorded = 0  # rows written to a shard (closed or open)
        self._queue: queue.SimpleQueue[Callable[[], dict[str, Any]] | None] = queue.SimpleQueue()
        self._shard = 0
        self._writer = secrets.token_hex(4)
        self._closed = False
        self.dropped = 0  # rows that could not be made or written (each logged)
        self._thread = threading.Thread(target=self._write, name=f"records-{directory.name}", daemon=True)
        self._thread.start()

    def put(self, make_row: Callable[[], dict[str, Any]]) -> None:
        """Queue a row, made on the writer's thread (a trajectory's row is O(its tokens) of work: not the event
        loop's). What it is made from must not change after it is queued (a finished job's trajectory does not)."""
        if self._closed or not self._thread.is_alive():
            self.dropped += 1
            log.error(
                "a record of %s was dropped: its writer is %s", self.directory, "closed" if self._closed else "dead"
            )
            return
        self._queue.put(make_row)

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def _write(self) -> None:
        """Rows are written a row group at a time: `flush_rows` of them, or what waited `flush_s`. A shard is closed
        when it is full, when it is `shard_age_s` old (rows or not: an open shard cannot be read), and at the end."""
        shard: _Shard | None = None
        rows: list[dict[str, Any]] = []
        flush_at = math.inf
        while True:
            wake = min(flush_at, shard.close_at if shard else math.inf)
            item: Any
            try:
                item = self._queue.get(timeout=None if math.isinf(wake) else max(0.0, wake - time.monotonic()))
            except queue.Empty:
                item = _NOTHING  # a deadline passed: nothing new
            closing = item is None
            if item is not None and item is not _NOTHING:
                try:
                    rows.append(item())
                except Exception:  # a row that cannot be made must not stop the records that follow
                    self.dropped += 1
                    log.exception("a record of %s could not be made", self.directory)
                    continue
                flush_at = min(flush_at, time.monotonic() + self.flush_s)
                if len(rows) < self.flush_rows:
                    continue
            if rows and (closing or len(rows) >= self.flush_rows or time.monotonic() >= flush_at):
                shard = self._written(shard, rows)
                rows, flush_at = [], math.inf
            if shard and (closing or shard.full(self.shard_bytes) or time.monotonic() >= shard.close_at):
                shard.close()
                shard = None
            if closing:
                return

    def _written(self, shard: _Shard | None, rows: list[dict[str, Any]]) -> _Shard | None:
        """`rows` written (into `shard`, or a new one), and the shard to go on with. What fails is logged and
        counted, never the writer's end: rows the schema refuses are dropped one by one (the others written), and
        a shard that cannot be written is abandoned for a new one."""
        try:
            table = pa.Table.from_pylist(rows, schema=self.schema)
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            fitting = [row for row in rows if self._fits(row)]
            if not fitting:
                return shard
            table = pa.Table.from_pylist(fitting, schema=self.schema)
        for attempt in range(2):
            try:
                shard = shard or _Shard(self._new_path(), self.schema, time.monotonic() + self.shard_age_s)
                shard.write(table)
                self.recorded += table.num_rows
                return shard
            except OSError:  # disk full, the directory removed: try once more in a new shard, then give them up
                log.exception("writing %s (attempt %d)", shard.path if shard else self.directory, attempt + 1)
                if shard is not None:
                    shard.abandon()
                shard = None
        self.dropped += table.num_rows
        return None

    def _fits(self, row: dict[str, Any]) -> bool:
        try:
            pa.Table.from_pylist([row], schema=self.schema)
            return True
        except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
            self.dropped += 1
            log.error("a record of %s (job %s) does not fit the schema: %s", self.directory, row.get("job_id"), exc)
            return False

    def _new_path(self) -> Path:
        """A name no other writer takes: two replicas whose ids read alike, or a restart within the second, have
        writers of their own (`_writer`)."""
        self._shard += 1
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        name = f"{stamp}-{self.replica}-{self._writer}-{self._shard:06d}.parquet"
        return self.directory / f"{OPEN_PREFIX}{name}{OPEN_SUFFIX}"


class _Shard:
    """One shard being written: `.NAME.parquet.open`, renamed `NAME.parquet` once closed."""

    def __init__(self, path: Path, schema: pa.Schema, close_at: float) -> None:
        self.path, self.close_at = path, close_at
        self._writer = pq.ParquetWriter(path, schema, compression="zstd")

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table)

    def full(self, shard_bytes: int) -> bool:
        try:
            return os.path.getsize(self.path) >= shard_bytes
        except OSError:  # gone (the directory removed): close it, and the next rows go to a new one
            return True

    def close(self) -> None:
        """Closed and renamed to its final name; a shard that cannot be (its directory gone) is logged."""
        try:
            self._writer.close()
            final = self.path.with_name(self.path.name.removeprefix(OPEN_PREFIX).removesuffix(OPEN_SUFFIX))
            self.path.rename(final)
        except OSError:
            log.exception("closing the record shard %s", self.path)

    def abandon(self) -> None:
        """A shard a write failed in: closed as it is and left `.open` (a reader skips it)."""
        with contextlib.suppress(Exception):
            self._writer.close()
