"""`prorl-rollout view DIR`: the rollout viewer (viewer/) over the records of a past or running service (a
`--record DIR`, records.py), read-only, with no service running.

It serves the same page and the same shapes as the live service's endpoints the page reads: `GET /v1/jobs` (the
recorded trajectories, newest first), `GET /v1/jobs/{id}/result` (the Trajectory, as `read_trajectories` gives it
back), `GET /v1/jobs/{id}/tokens` (its token pieces, with `--tokenizer`; ids without), and a `GET /v1/status`
that says which records these are. The same rules as `serve`: loopback unless given a token (then every data
endpoint needs it; the page itself holds no data and is public), and the browser checks of a token-less server.

Reading: a closed shard is never written again, so each is read once (the columns the list shows), when the
viewer starts and when a list is asked for after the service closed a new one; a trajectory's row is read from its
shard's row group when it is opened. Shards still `.open` (being written, or left by a killed service) are skipped,
as every reader of a record directory does.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, Field

from server_kit.address import check_exposure
from server_kit.cli import Readiness, StartupError, fail, log_level, stopped_by
from server_kit.errors import ApiError
from server_kit.openapi import API, Operation, Reply, operations_under
from server_kit.webapp import Site, bound_socket, json_api, json_response, serve_sites

from .. import __version__
from ..models import JobList, JobsQuery, JobState, JobSummary, StageTimings, Trajectory, TrajectoryTokens, WaitQuery
from . import viewer
from .chat import ChatTokenizer
from .records import OPEN_PREFIX, OPEN_SUFFIX, RECORD_SCHEMA, TRAJECTORY_SCHEMA, current_row, row_trajectory

log = logging.getLogger(__name__)
PROG = "prorl-rollout view"
DEFAULT_PORT = 8767
TOKEN_VARIABLE = "PRORL_VIEW_TOKEN"
MAX_BODY_BYTES = 64 * 1024  # it takes no bodies
SUMMARY_COLUMNS = [
    "schema_version",
    "recorded_at",
    "job_id",
    "task",
    "state",
    "timings",
    "reward",
    "reward_components",
    "num_turns",
    "finish_reason",
    "policy_version_min",
    "policy_version_max",
    "error_class",
    "error_message",
    "filter",
    "labels",
    "group",
    "attempt",
]


class RecordsStatus(BaseModel):
    """GET /v1/status of `prorl-rollout view DIR`: which records are shown (the page tells it from a live
    service's status by `source`)."""

    source: str = Field(description="`records of DIR`")
    directory: str
    trajectories: int = Field(description="trajectories in the closed shards")
    shards: int = Field(description="closed shards read")
    open_shards: int = Field(description="shards still .open (being written, or left by a killed service): skipped")
    policy_version: int | None = Field(description="the newest policy version the records hold")
    tokenizer: str | None = Field(description="the tokenizer the token view decodes with (--tokenizer); null: ids")


class UnknownRecord(ApiError, KeyError):
    status = 404

    def __str__(self) -> str:
        return f"no record of job {self.args[0]!r} in the closed shards"


@dataclass(frozen=True)
class Where:
    """A recorded trajectory's row: its shard, row group and index in that group."""

    path: Path
    group: int
    index: int


class RecordIndex:
    """The trajectories of a record directory's closed shards: each shard's list columns, read once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.shards: dict[Path, list[dict[str, Any]]] = {}  # closed shard -> its rows' list columns
        self.where: dict[str, Where] = {}  # job id -> its row (the last recorded, where a job was recorded twice)
        self.open_shards: set[Path] = set()
        self._lock = threading.Lock()  # refreshed on a thread; two requests at once read a shard once
        self._newest_first: list[dict[str, Any]] | None = None  # `rows()`, made by `refresh`
        self._newest_version: int | None = None

    def refresh(self) -> None:
        """Read the shards closed since the last refresh, and order the rows (blocking: call it off the event
        loop; what the handlers read on the loop, `rows()` and `newest_version()`, is made here)."""
        with self._lock:
            shards = self.directory / "trajectories"
            open_now = set(shards.glob(f"{OPEN_PREFIX}*.parquet{OPEN_SUFFIX}"))
            for path in sorted(open_now - self.open_shards):
                log.warning("%s: not closed (being written, or its service was killed): skipped", path)
            self.open_shards = open_now
            closed = sorted(p for p in shards.glob("*.parquet") if not p.name.startswith(OPEN_PREFIX))
            new = [path for path in closed if path not in self.shards and not path.is_symlink()]
            for path in new:
                self._read(path)
            if new or self._newest_first is None:
                self._order()

    def _read(self, path: Path) -> None:
        shard = pq.ParquetFile(path)
        rows: list[dict[str, Any]] = []
        for group in range(shard.num_row_groups):
            for index, row in enumerate(shard.read_row_group(group, columns=SUMMARY_COLUMNS).to_pylist()):
                if row["schema_version"] > RECORD_SCHEMA:  # an earlier one reads as `read_rows` reads it
                    raise ValueError(f"{path}: record schema {row['schema_version']} is newer than {RECORD_SCHEMA}")
                row["where"] = Where(path, group, index)
                rows.append(row)
        self.shards[path] = rows

    def _order(self) -> None:
        """Newest first, a job recorded twice (replicas sharing the directory) by its last record, which is the
        one its page opens too."""
        rows = [row for rows in self.shards.values() for row in rows]  # shard by shard, as written
        order = sorted(range(len(rows)), key=lambda i: (rows[i]["recorded_at"], i), reverse=True)
        seen: set[str] = set()
        newest_first = []
        for row in (rows[i] for i in order):
            if row["job_id"] not in seen:
                seen.add(row["job_id"])
                newest_first.append(row)
        self.where = {row["job_id"]: row["where"] for row in newest_first}
        self._newest_version = max((row["policy_version_max"] for row in rows), default=None)
        self._newest_first = newest_first

    def rows(self) -> list[dict[str, Any]]:
        """Every recorded trajectory's list columns, newest first (as the last `refresh` left them)."""
        return self._newest_first or []

    def newest_version(self) -> int | None:
        return self._newest_version

    def trajectory(self, job_id: str) -> Trajectory:
        """The recorded trajectory of `job_id`, read from its row group (blocking: off the event loop)."""
        where = self.where.get(job_id)
        if where is None:
            raise UnknownRecord(job_id)
        row = pq.ParquetFile(where.path).read_row_group(where.group).slice(where.index, 1).to_pylist()[0]
        return row_trajectory(current_row(row, TRAJECTORY_SCHEMA, where.path))


def record_summary(row: dict[str, Any], policy_version: int | None) -> JobSummary:
    recorded_at: datetime = row["recorded_at"]
    staleness = None if policy_version is None else policy_version - row["policy_version_min"]
    return JobSummary(
        job_id=row["job_id"],
        task=row["task"],
        state=JobState(row["state"]),
        submitted_at=None,
        recorded_at=recorded_at.timestamp(),
        timings=StageTimings(**row["timings"]),
        reward=row["reward"],
        reward_components=dict(row["reward_components"]),
        num_turns=row["num_turns"],
        finish_reason=row["finish_reason"],
        policy_version_min=row["policy_version_min"],
        policy_version_max=row["policy_version_max"],
        staleness=staleness,
        error_class=row["error_class"],
        error=row["error_message"],
        filter=row["filter"],
        labels=dict(row["labels"]),
        group=row["group"],
        attempt=row["attempt"],
    )


INDEX = web.AppKey("index", RecordIndex)
TOKENIZER = web.AppKey("tokenizer", object)  # ChatTokenizer, or None: ids only


async def records_status(request: web.Request) -> web.Response:
    index = request.app[INDEX]
    await asyncio.to_thread(index.refresh)
    tokenizer = request.app[TOKENIZER]
    return json_response(
        RecordsStatus(
            source=f"records of {index.directory}",
            directory=str(index.directory),
            trajectories=len(index.where),
            shards=len(index.shards),
            open_shards=len(index.open_shards),
            policy_version=index.newest_version(),
            tokenizer=getattr(tokenizer, "name", None),
        )
    )


async def list_records(request: web.Request, query: JobsQuery) -> web.Response:
    index = request.app[INDEX]
    await asyncio.to_thread(index.refresh)
    version = index.newest_version()
    chosen, matched = viewer.matching(index.rows(), lambda row: row["state"], lambda row: row["task"], query)
    jobs = [record_summary(row, version) for row in chosen]
    source = f"records of {index.directory}"
    return json_response(JobList(jobs=jobs, matched=matched, policy_version=version, source=source))


async def record_result(request: web.Request, query: WaitQuery) -> web.Response:
    """The recorded trajectory (`wait` is taken, for the live endpoint's shape, and has nothing to wait for)."""
    trajectory = await asyncio.to_thread(request.app[INDEX].trajectory, request.match_info["id"])
    return json_response(trajectory)


async def record_tokens(request: web.Request) -> web.Response:
    trajectory = await asyncio.to_thread(request.app[INDEX].trajectory, request.match_info["id"])
    chat = request.app[TOKENIZER]
    if chat is None:
        return json_response(await asyncio.to_thread(viewer.trajectory_tokens, trajectory, None))
    return json_response(await chat.off_loop(viewer.trajectory_tokens, trajectory, chat))


record_op = operations_under(
    "/v1/jobs/{id}",
    {"id": {"type": "string", "description": "a recorded job's job_id"}},
    {404: "no record of this job in the closed shards"},
    "records",
)

VIEW_API = API(
    name="records-viewer",
    program=PROG,
    title="prorl-rollout view: the rollout viewer over a --record directory",
    version=__version__,
    description="The rollout viewer's page and the read-only endpoints it reads, answered from the records of a "
    "service's --record directory (docs/viewer.md).",
    default_port=DEFAULT_PORT,
    operations=(
        Operation(
            "GET",
            "/v1/status",
            records_status,
            "Which records are shown",
            (Reply(200, "", RecordsStatus),),
            tag="records",
        ),
        Operation(
            "GET",
            "/v1/jobs",
            list_records,
            "The recorded trajectories, newest first",
            (Reply(200, "", JobList),),
            query=JobsQuery,
            tag="records",
        ),
        record_op(
            "GET", "/result", record_result, "A recorded trajectory", (Reply(200, "", Trajectory),), query=WaitQuery
        ),
        record_op(
            "GET",
            "/tokens",
            record_tokens,
            "A recorded trajectory as token pieces (ids only without --tokenizer)",
            (Reply(200, "", TrajectoryTokens),),
        ),
        *viewer.page_operations("viewer"),
    ),
)


def create_view_app(
    directory: Path, token: str | None = None, tokenizer: ChatTokenizer | None = None
) -> web.Application:
    """The viewer over `directory`'s records; `tokenizer` (None: ids only) decodes the token view."""
    requests = Counter("prorl_view_http_requests", "HTTP requests", ["route", "status"], registry=CollectorRegistry())
    app = json_api(VIEW_API, token, MAX_BODY_BYTES, requests)
    app[INDEX] = RecordIndex(directory)
    app[TOKENIZER] = tokenizer

    async def first_read(app: web.Application) -> None:
        await asyncio.to_thread(app[INDEX].refresh)  # a directory that cannot be read fails the start

    app.on_startup.append(first_read)
    return app


# -- the command ----------------------------------------------------------------------------------------------
def add_view_parser(sub: Any) -> None:
    view = sub.add_parser("view", help="serve the rollout viewer over a --record directory (docs/viewer.md)")
    view.add_argument("directory", type=Path, metavar="DIR", help="a --record directory")
    view.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    view.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default: {DEFAULT_PORT}; 0: free)")
    view.add_argument(
        "--tokenizer",
        default=None,
        help="the policy's tokenizer (a directory or a Hugging Face Hub name): the token view shows each token's "
        "text; without it, the ids",
    )
    view.add_argument(
        "--token",
        default=os.environ.get(TOKEN_VARIABLE),
        help=f"the API token (env {TOKEN_VARIABLE}); needed to listen beyond loopback",
    )
    view.add_argument("--log-level", type=log_level, default="INFO")


def run_view(args: argparse.Namespace, ready: Callable[[str], None] | None = None) -> int:
    """`prorl-rollout view DIR`: checks that fail fast, then serve until SIGTERM/SIGINT."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    directory: Path = args.directory.expanduser()
    if not (directory / "trajectories").is_dir():
        return fail(PROG, f"{directory} holds no trajectories/ folder: give a --record directory of the service")
    if not 0 <= args.port <= 65535:
        return fail(PROG, f"--port {args.port} is not a port: give one in 1-65535 (0: a free one)")
    try:
        check_exposure(args.host, args.token, TOKEN_VARIABLE)
    except ValueError as exc:
        return fail(PROG, str(exc))
    readiness = Readiness()
    from server_kit.webapp import run_forever

    try:
        run_forever(_serve(directory, args, readiness, ready))
    except Exception as exc:
        return stopped_by(PROG, exc, readiness, args.log_level == "DEBUG", f"{type(exc).__name__}: {exc}")
    return 0


async def _serve(
    directory: Path, args: argparse.Namespace, readiness: Readiness, ready: Callable[[str], None] | None
) -> None:
    tokenizer = None
    if args.tokenizer is not None:
        path = Path(args.tokenizer).expanduser()
        name = str(path) if path.is_dir() else args.tokenizer
        try:
            tokenizer = await asyncio.to_thread(ChatTokenizer, name)
        except Exception as exc:  # transformers' errors have no common root: any of them is this flag's problem
            raise StartupError(f"--tokenizer {args.tokenizer}: cannot be loaded ({type(exc).__name__}: {exc})") from exc
    try:
        sock = bound_socket(args.host, args.port)
    except OSError as exc:
        raise StartupError(
            f"cannot listen on {args.host}:{args.port} ({os.strerror(exc.errno) if exc.errno else exc}): give --port "
            "a free port, or stop what holds this one"
        ) from exc
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/viewer"

    def listening() -> None:
        readiness()
        print(
            f"{PROG}: the records of {directory} at {url}" + ("#token=<your token>" if args.token else ""), flush=True
        )
        if ready is not None:
            ready(url)

    app = create_view_app(directory, args.token, tokenizer)
    await serve_sites([Site(app, host, port, PROG, sock=sock)], ready=listening)
