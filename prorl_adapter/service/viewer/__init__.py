"""The rollout viewer (docs/viewer.md): a static page, and what its endpoints answer, for both servers that serve
it (the live service, server.py, and `prorl-rollout view DIR` over a --record directory, records_viewer.py).

The page is three files of this package (index.html, viewer.js, viewer.css), plain JavaScript with no framework
and nothing fetched from elsewhere: it works offline and needs no build step. It carries no data, so it is served
without the token (`public` operations); its script reads the token from the URL's fragment (`#token=...`,
which a browser never sends) or a box on the page, keeps it in sessionStorage and calls the JSON API with it.
Every piece of trajectory text reaches the DOM as a text node, never as markup, and the page's
Content-Security-Policy allows only this server's own scripts and styles: a trajectory whose text is HTML or a
script shows as text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, TypeVar

from aiohttp import web

from server_kit.openapi import Operation, Reply

from ...models import (
    JobError,
    JobsQuery,
    JobState,
    JobSummary,
    StageTimings,
    TokenSequence,
    Trajectory,
    TrajectoryTokens,
)

T = TypeVar("T")
STATIC = Path(__file__).resolve().parent
ASSETS = ("viewer.js", "viewer.css")  # served at /viewer/NAME, beside the page (index.html) at /viewer
SECURITY_HEADERS = {
    # Scripts, styles and fetches of this server only; no inline script or style, no plugin, no framing.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _file(name: str, media_type: str) -> web.Response:
    body = (STATIC / name).read_bytes()
    return web.Response(body=body, content_type=media_type, charset="utf-8", headers=SECURITY_HEADERS)


async def viewer_page(request: web.Request) -> web.Response:
    """The viewer's page (public: it holds no data; its script asks the API with the token)."""
    return _file("index.html", "text/html")


async def viewer_script(request: web.Request) -> web.Response:
    return _file("viewer.js", "text/javascript")


async def viewer_style(request: web.Request) -> web.Response:
    return _file("viewer.css", "text/css")


def page_operations(tag: str) -> tuple[Operation, ...]:
    """GET /viewer and its script and style, public (fixed routes: no path is ever joined from a request)."""
    return (
        Operation(
            "GET",
            "/viewer",
            viewer_page,
            "The rollout viewer: a web page of the jobs and their trajectories (docs/viewer.md)",
            (Reply(200, "the page; it reads the token from #token=... or asks for it", media_type="text/html"),),
            public=True,
            tag=tag,
        ),
        Operation(
            "GET",
            "/viewer/viewer.js",
            viewer_script,
            "The viewer page's script",
            (Reply(200, "", media_type="text/javascript"),),
            public=True,
            tag=tag,
        ),
        Operation(
            "GET",
            "/viewer/viewer.css",
            viewer_style,
            "The viewer page's style",
            (Reply(200, "", media_type="text/css"),),
            public=True,
            tag=tag,
        ),
    )


def summary(
    job_id: str,
    task: str,
    state: JobState,
    timings: StageTimings,
    trajectory: Trajectory | None,
    error: JobError | None,
    policy_version: int | None,
    submitted_at: float | None = None,
    recorded_at: float | None = None,
) -> JobSummary:
    """A job's line in the viewer's list; `policy_version` is the one its staleness is counted from."""
    t = trajectory
    finished = t is not None and state.finished
    error = error or (t.error if t is not None else None)
    staleness = None
    if finished and policy_version is not None:
        staleness = policy_version - t.policy_version_min
    return JobSummary(
        job_id=job_id,
        task=task,
        state=state,
        submitted_at=submitted_at,
        recorded_at=recorded_at,
        timings=timings,
        reward=t.reward if finished else None,
        reward_components=dict(t.reward_components) if finished else {},
        num_turns=t.num_turns if finished else None,
        finish_reason=t.finish_reason if finished else None,
        policy_version_min=t.policy_version_min if finished else None,
        policy_version_max=t.policy_version_max if finished else None,
        staleness=staleness,
        error_class=error.error_class if error else None,
        error=error.message if error else None,
        filter=t.filter if finished else None,
        labels=dict(t.labels) if t is not None else {},
        group=t.group if t is not None else None,
        attempt=t.attempt if t is not None else 1,
    )


def matching(
    items: Iterable[T], state: Callable[[T], JobState], task: Callable[[T], str], query: JobsQuery
) -> tuple[list[T], int]:
    """The items (jobs or records, newest first) that `query` selects, at most its limit, and how many matched in
    all. Only the chosen ones are then summarised: a replica keeps up to 100,000 jobs."""
    chosen: list[T] = []
    matched = 0
    for item in items:
        if (query.state is None or state(item) == query.state) and (query.task is None or task(item) == query.task):
            matched += 1
            if len(chosen) < query.limit:
                chosen.append(item)
    return chosen, matched


REPLACEMENT = "\ufffd"
WINDOW = 6  # tokens of context a piece is decoded with: a byte-level BPE character spans at most 4


class Detokenizer(Protocol):
    """What the token view needs of a tokenizer (`ChatTokenizer` has it)."""

    name: str

    def decode(self, ids: list[int]) -> str: ...

    def token_texts(self, ids: list[int]) -> list[str]: ...


def token_pieces(ids: list[int], decode: Callable[[list[int]], str], singles: list[str] | None = None) -> list[str]:
    """Each id's piece of the text `decode(ids)`, so that the pieces concatenate to it. `singles`: each id
    decoded alone (a tokenizer's batch decode gives them at once), else decoded here.

    Decoded one by one, ids lose what depends on their neighbours: a character whose bytes span tokens (each alone
    decodes to U+FFFD), a SentencePiece word's leading space. Where the single pieces do not concatenate to the
    text, a run of tokens that decode alone to U+FFFD is decoded as one, its text on its last token; where that
    does not do either, each token's piece is what it adds to the text of the few tokens before it (`windowed`)."""
    singles = [decode([i]) for i in ids] if singles is None else singles
    text = decode(ids)
    if "".join(singles) == text:
        return singles  # the common case: every id decodes alone to its own text
    pieces = list(singles)
    i = 0
    while i < len(ids):
        if REPLACEMENT not in singles[i]:
            i += 1
            continue
        end = i
        while end < len(ids) and REPLACEMENT in singles[end]:
            end += 1
        pieces[i:end] = [""] * (end - i - 1) + [decode(ids[i:end])]
        i = end
    return pieces if "".join(pieces) == text else windowed(ids, decode)


def windowed(ids: list[int], decode: Callable[[list[int]], str]) -> list[str]:
    """Each token's piece as what it adds to the text of the WINDOW tokens before it; a token that ends inside a
    character has an empty piece, the character is on its last token. Two short decodes per token."""
    pieces: list[str] = []
    start = 0  # the first token of the context window
    done = 0  # tokens whose text is in `pieces` (those after it are pending: inside a character)
    for end in range(1, len(ids) + 1):
        text = decode(ids[start:end])
        if text.endswith(REPLACEMENT) and end - done < 4 and end < len(ids):
            continue  # a character not complete yet (a U+FFFD the tokens really hold is given after 4)
        before = decode(ids[start:done])
        pieces += [""] * (end - done - 1) + [text[len(before) :] if text.startswith(before) else text]
        done = end
        start = max(start, done - WINDOW)
    return pieces


def sequence_versions(trajectory: Trajectory) -> list[list[int | None]]:
    """The policy version of each response token of each of the trajectory's sequences (null: not sampled)."""
    t = trajectory
    versions = []
    for k, segment in enumerate(t.all_segments()):
        turns = [turn.model_copy(update={"segment": 0}) for turn in t.turns if turn.segment == k]
        own = t.model_copy(update={**dict(segment), "turns": turns, "segments": []})
        versions.append(own.token_versions())
    return versions


def trajectory_tokens(trajectory: Trajectory, tokenizer: Detokenizer | None) -> TrajectoryTokens:
    """The token view of `trajectory`: its pieces by `tokenizer` (None: none, no pieces) and the versions. Work of
    the order of its tokens: run it off the event loop (on the tokenizer's thread)."""

    def pieces(ids: list[int]) -> list[str] | None:
        return None if tokenizer is None else token_pieces(ids, tokenizer.decode, tokenizer.token_texts(ids))

    sequences = [
        TokenSequence(prompt=pieces(segment.prompt_ids), response=pieces(segment.response_ids), versions=versions)
        for segment, versions in zip(trajectory.all_segments(), sequence_versions(trajectory), strict=True)
    ]
    name = None if tokenizer is None else tokenizer.name
    return TrajectoryTokens(job_id=trajectory.job_id, tokenizer=name, sequences=sequences)
