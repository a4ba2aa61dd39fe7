"""Training data from the records of a run (`prorl-rollout export`, docs/records.md): chat-format SFT data and
token-level RL data, of the trajectories a `RecordFilter` admits.

- **SFT** (`sft_examples`): one conversation per token sequence, as SFT trainers take it (TRL's conversational
  format, verl's `MultiTurnSFTDataset`): `messages` (system, user, then each assistant turn and the tool
  results that followed it) and `tools` (the schemas the chat template was given, or null; JSON text in Parquet,
  where one column type cannot hold tools whose parameters differ). An assistant turn's
  `content` is the text the policy wrote, its tool calls in it as it wrote them: rendered back by the same chat
  template it gives the tokens that were sampled, so training on it teaches what the policy did, in the format
  its parser reads. An agent program's conversation is its last call of each sequence, as the gateway saw it
  (its own messages, tool calls and tool results in OpenAI's shape), and the answer.
- **RL** (`rl_rows`): one row per token sequence with the ids, the mask, the logprobs, each token's policy
  version, the reward and the group, in the columns verl's and SkyRL's loaders read (`prompt`: the chat
  messages, `data_source`: the task), so a prompt dataset of either reads the file as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .records import read_rows, row_trajectory

NO_ERROR = "none"  # the error class `--error-class` names a trajectory without an error by


@dataclass(frozen=True)
class RecordFilter:
    """Which recorded trajectories to export; an unset field admits all. `error_classes` may name `none` (no
    error); a trajectory the service marked `filter` (an infrastructure failure) is left out unless
    `include_filtered`."""

    since: datetime | None = None
    until: datetime | None = None
    tasks: frozenset[str] = frozenset()
    min_reward: float | None = None
    max_reward: float | None = None
    min_version: int | None = None  # of the oldest token (policy_version_min)
    max_version: int | None = None  # of the newest token (policy_version_max)
    labels: dict[str, str] = field(default_factory=dict)
    error_classes: frozenset[str] = frozenset()
    states: frozenset[str] = frozenset()
    include_filtered: bool = False

    def admits(self, row: dict[str, Any]) -> bool:
        checks = (
            self.since is None or row["recorded_at"] >= self.since,
            self.until is None or row["recorded_at"] < self.until,
            not self.tasks or row["task"] in self.tasks,
            self.min_reward is None or row["reward"] >= self.min_reward,
            self.max_reward is None or row["reward"] <= self.max_reward,
            self.min_version is None or row["policy_version_min"] >= self.min_version,
            self.max_version is None or row["policy_version_max"] <= self.max_version,
            not self.error_classes or (row["error_class"] or NO_ERROR) in self.error_classes,
            not self.states or row["state"] in self.states,
            self.include_filtered or not row["filter"],
        )
        labels = dict(row["labels"])
        return all(checks) and all(labels.get(k) == v for k, v in self.labels.items())


# The columns RecordFilter.admits reads.
FILTER_COLUMNS = [
    "recorded_at",
    "job_id",
    "task",
    "reward",
    "policy_version_min",
    "policy_version_max",
    "error_class",
    "state",
    "filter",
    "labels",
]


def admitted_rows(directory: Path, only: RecordFilter, columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """The admitted rows, whole or with `columns` (the filter's besides)."""
    read = None if columns is None else sorted(set(FILTER_COLUMNS) | set(columns))
    return (row for row in read_rows(directory, columns=read) if only.admits(row))


# -- SFT -------------------------------------------------------------------------------------------------
@dataclass
class Skipped:
    """What an export left out, and why (said by the CLI)."""

    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


_CALL = pa.struct([("type", pa.string()), ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
SFT_SCHEMA = pa.schema(
    [
        (
            "messages",
            pa.list_(
                pa.struct(
                    [
                        ("role", pa.string()),
                        ("content", pa.string()),
                        ("tool_calls", pa.list_(_CALL)),  # arguments as JSON text, as OpenAI's messages hold them
                        ("tool_call_id", pa.string()),
                        ("name", pa.string()),
                    ]
                )
            ),
        ),
        # JSON text: tools' schemas differ (their parameters), and one Parquet column of structs would give each
        # tool the others' fields as null, which a chat template renders: the prompt would not be the one sampled.
        ("tools", pa.string()),
        ("job_id", pa.string()),
        ("task", pa.string()),
        ("reward", pa.float64()),
        ("group", pa.string()),
        ("policy_version_min", pa.int64()),
        ("policy_version_max", pa.int64()),
    ]
)
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name")


def sft_examples(directory: Path, only: RecordFilter, skipped: Skipped | None = None) -> Iterator[dict[str, Any]]:
    """The conversations of the admitted trajectories (one per token sequence)."""
    skipped = skipped if skipped is not None else Skipped()
    calls: dict[str, list[dict[str, Any]]] | None = None  # read when an agent program's trajectory needs them
    for row in admitted_rows(directory, only):
        trajectory = row_trajectory(row)
        if trajectory.prompt_messages:
            conversations = [(trajectory.prompt_messages + _loop_turns(trajectory), trajectory.prompt_tools)]
        elif trajectory.turns:
            calls = _episode_calls(directory, _program_jobs(directory, only)) if calls is None else calls
            conversations = _program_conversations(trajectory, calls.get(row["job_id"], []))
            if not conversations:
                skipped.add("no recorded chat calls (a completions-protocol agent, or records of schema 1)")
        else:
            skipped.add("no turns")
            continue
        meta = {
            "job_id": trajectory.job_id,
            "task": trajectory.task,
            "reward": trajectory.reward,
            "group": trajectory.group,
            "policy_version_min": trajectory.policy_version_min,
            "policy_version_max": trajectory.policy_version_max,
        }
        for messages, tools in conversations:
            yield {"messages": [_message(m) for m in messages], "tools": tools and json.dumps(tools), **meta}


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message with the fields of SFT_SCHEMA: text content (a harness's list of text parts joined), tool
    calls with their arguments as JSON text."""
    out = {key: message.get(key) for key in MESSAGE_FIELDS}
    if isinstance(out["content"], list):
        out["content"] = "".join(part.get("text", "") for part in out["content"])
    if out["tool_calls"]:
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c["function"]["name"], "arguments": _json_text(c)}}
            for c in out["tool_calls"]
        ]
    return out


def _loop_turns(trajectory: Any) -> list[dict[str, Any]]:
    """The built-in agent loop's turns as messages: the policy's text, then its tools' results where they were
    put into the context (the last turn's are not: no policy turn read them)."""
    messages: list[dict[str, Any]] = []
    for turn in trajectory.turns:
        messages.append({"role": "assistant", "content": turn.text})
        messages += [{"role": "tool", "content": result} for result in turn.tool_results]
    return messages


def _program_jobs(directory: Path, only: RecordFilter) -> set[str]:
    """The admitted trajectories that an agent program made (no prompt messages of the agent loop's, some turns)."""
    rows = admitted_rows(directory, only, ["prompt_messages_json", "num_turns"])
    return {r["job_id"] for r in rows if r["num_turns"] and r["prompt_messages_json"] in (None, "[]")}


# What a conversation needs of a gateway call: not its ids and logprobs.
CALL_COLUMNS = ["job_id", "episode", "call", "segment", "in_episode_log", "text", "messages_json", "tools_json"]


def _episode_calls(directory: Path, jobs: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The gateway calls of `jobs` that are part of an episode's log (every run of a job: `_program_conversations`
    picks the delivered one), with CALL_COLUMNS and the reply."""
    if not (directory / "gateway_calls").is_dir() or not jobs:
        return {}
    calls: dict[str, list[dict[str, Any]]] = {}
    for row in read_rows(directory, "gateway_calls", columns=[*CALL_COLUMNS, "reply_json"]):
        if row["in_episode_log"] and row["job_id"] in jobs:
            calls.setdefault(row["job_id"], []).append(row)
    return calls


def _program_conversations(trajectory: Any, calls: list[dict[str, Any]]) -> list[tuple[list[dict], list | None]]:
    """An agent program's conversations: of the run whose calls are the trajectory's turns, each sequence's last
    call (its messages hold the earlier ones') and its answer."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for call in calls:
        runs.setdefault(call["episode"], []).append(call)
    texts = [turn.text for turn in trajectory.turns]
    for run in runs.values():
        run.sort(key=lambda call: call["call"])
        if [call["text"] for call in run] != texts or any(call["messages_json"] is None for call in run):
            continue
        last = {call["segment"]: call for call in run}  # sorted by index: the last call of each sequence wins
        return [
            ([*json.loads(call["messages_json"]), _reply(call)], json.loads(call["tools_json"]))
            for _, call in sorted(last.items())
        ]
    return []


def _reply(call: dict[str, Any]) -> dict[str, Any]:
    """The answer as an assistant message."""
    reply = json.loads(call["reply_json"])
    if not reply.get("tool_calls"):
        reply.pop("tool_calls", None)
    return reply


def _json_text(call: dict[str, Any]) -> str:
    arguments = call["function"]["arguments"]
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


# -- RL --------------------------------------------------------------------------------------------------
RL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),  # the task: verl's name for it
        # the prompt's chat messages, as verl's and SkyRL's prompt datasets read them (null: an agent program's)
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("job_id", pa.string()),
        ("sequence", pa.int32()),  # 0: the trajectory's own; k: its k-th further segment (agent programs)
        ("group", pa.string()),
        ("reward", pa.float64()),
        ("reward_components", pa.string()),  # JSON text: `datasets` (verl's and SkyRL's loaders) reads no map type
        ("policy_version_min", pa.int64()),
        ("policy_version_max", pa.int64()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("response_mask", pa.list_(pa.int8())),
        ("response_logprobs", pa.list_(pa.float64())),
        ("token_versions", pa.list_(pa.int64())),
        ("labels", pa.string()),  # JSON text, as reward_components
    ]
)


def rl_rows(directory: Path, only: RecordFilter) -> Iterator[dict[str, Any]]:
    """One row per token sequence of each admitted trajectory. Every sequence of an episode carries its reward
    and group (a trainer computes the episode's advantage once and gives it to each)."""
    from ..models import BatchItem

    for row in admitted_rows(directory, only):
        trajectory = row_trajectory(row)
        prompt = [{"role": m["role"], "content": m["content"]} for m in trajectory.prompt_messages] or None
        item = BatchItem(id=trajectory.job_id, trajectory=trajectory)
        for sequence, part in enumerate(item.segment_items()):
            t = part.trajectory
            yield {
                "data_source": t.task,
                "prompt": prompt if sequence == 0 else None,
                "job_id": t.job_id,
                "sequence": sequence,
                "group": t.group or t.job_id,  # no group named: an episode compared with none but itself
                "reward": t.reward,
                "reward_components": json.dumps(t.reward_components),
                "policy_version_min": t.policy_version_min,
                "policy_version_max": t.policy_version_max,
                "prompt_ids": t.prompt_ids,
                "response_ids": t.response_ids,
                "response_mask": t.response_mask,
                "response_logprobs": t.response_logprobs,
                "token_versions": part.token_versions(),
                "labels": json.dumps(t.labels),
            }


# -- files -----------------------------------------------------------------------------------------------
ROWS_PER_GROUP = 1024


def _json_row(row: dict[str, Any], schema: pa.Schema) -> dict[str, Any]:
    """A row for JSON Lines: maps as objects, the JSON-text columns of Parquet as what they hold, and a message's
    fields only where set."""
    out = dict(row)
    for name in schema.names:
        if pa.types.is_map(schema.field(name).type) and out.get(name) is not None:
            out[name] = dict(out[name])
    if "messages" in out:  # TRL's conversational format: a message's set fields, a call's arguments as an object
        out["messages"] = [_trl_message(m) for m in out["messages"]]
        out["tools"] = out.get("tools") and json.loads(out["tools"])
    return out


def _trl_message(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    for call in out.get("tool_calls", []):
        with contextlib.suppress(ValueError):  # arguments that are not JSON stay the text they are
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def write_sft(path: Path, directory: Path, only: RecordFilter, skipped: Skipped) -> int:
    """The SFT conversations into `path`. A Parquet file has a `tools` column only where a conversation had tools
    (verl's reader gives a column of nulls as NA, which it passes to the chat template as tools)."""
    schema = SFT_SCHEMA
    if path.suffix == ".parquet" and not any(example["tools"] for example in sft_examples(directory, only)):
        schema = schema.remove(schema.get_field_index("tools"))
    examples = sft_examples(directory, only, skipped)
    return write_rows(path, ({k: v for k, v in e.items() if k in schema.names} for e in examples), schema)


def write_rows(path: Path, rows: Iterable[dict[str, Any]], schema: pa.Schema) -> int:
    """Write `rows` to `path` (`.parquet`, or `.jsonl`), whole or not at all: into a hidden file beside it,
    renamed over `path` once complete. Returns the number of rows."""
    temporary = path.with_name(f".{path.name}.partial")
    count = 0
    try:
        if path.suffix == ".jsonl":
            with temporary.open("w", encoding="utf-8") as out:
                for row in rows:
                    out.write(json.dumps(_json_row(row, schema), ensure_ascii=False) + "\n")
                    count += 1
        else:
            count = _write_parquet(temporary, rows, schema)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return count


def _write_parquet(path: Path, rows: Iterable[dict[str, Any]], schema: pa.Schema) -> int:
    """Parquet, a row group at a time."""
    count = 0
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        batch: list[dict[str, Any]] = []
        for row in rows:
            batch.append(row)
            count += 1
            if len(batch) >= ROWS_PER_GROUP:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                batch.clear()
        writer.write_table(pa.Table.from_pylist(batch, schema=schema))
    return count
