"""Imported trajectories (`POST /v1/trajectories`, `prorl-rollout import`): checked whole, then turned into the
trajectories the buffer holds, so that the trainer and the staleness plugin see them as the service's own.

A check that fails is an `ImportRefused` (400) naming the field (`trajectories[3].response_mask`); nothing is
put until every trajectory of the request passed.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter

from server_kit.errors import ApiError

from ..models import ImportedTrajectory, ImportRequest, Resumption, StageTimings, Trajectory, Turn

IMPORTED_SERVER = "imported"  # the llm_server of an imported trajectory's turns


class ImportRefused(ApiError, ValueError):
    status = 400


def imported_trajectories(body: ImportRequest, vocab_size: int, current_version: int) -> list[Trajectory]:
    """The request's trajectories as the buffer holds them, or ImportRefused for the first field that is wrong. A
    token cannot have been sampled by a version newer than the service's `current_version` (the staleness plugin
    would refuse to weigh it, and every take would fail on it)."""
    seen: set[str] = set()
    for index, item in enumerate(body.trajectories):
        where = f"trajectories[{index}]"
        if item.job_id is not None and item.job_id in seen:
            raise ImportRefused(f"{where}.job_id: {item.job_id!r} is given to an earlier trajectory too")
        seen.add(item.job_id or "")
        _check(item, where, vocab_size, current_version)
        if body.group_sizes is not None and item.group not in body.group_sizes:
            raise ImportRefused(f"{where}.group: {item.group!r} is not one of group_sizes")
    if body.group_sizes is not None:
        counts = Counter(t.group for t in body.trajectories)
        for group, size in body.group_sizes.items():
            if counts[group] != size:
                raise ImportRefused(f"group_sizes.{group}: {size} declared, {counts[group]} given")
    return [_trajectory(item) for item in body.trajectories]


def _check(item: ImportedTrajectory, where: str, vocab_size: int, current_version: int) -> None:
    n = len(item.response_ids)
    if not math.isfinite(item.reward):
        raise ImportRefused(f"{where}.reward: {item.reward} is not a finite number")
    for name, value in item.reward_components.items():
        if not math.isfinite(value):
            raise ImportRefused(f"{where}.reward_components.{name}: {value} is not a finite number")
    bad = next((k for k, lp in enumerate(item.response_logprobs) if not (math.isfinite(lp) and lp <= 0.0)), None)
    if bad is not None:
        value = item.response_logprobs[bad]
        raise ImportRefused(f"{where}.response_logprobs[{bad}]: {value} is not a logprob (a finite number <= 0)")
    for name in ("response_mask", "response_logprobs", "token_versions"):
        values = getattr(item, name)
        if values is not None and len(values) != n:
            raise ImportRefused(f"{where}.{name}: {len(values)} entries for {n} response_ids")
    for name in ("prompt_ids", "response_ids"):
        bad = next((k for k, i in enumerate(getattr(item, name)) if not 0 <= i < vocab_size), None)
        if bad is not None:
            value = getattr(item, name)[bad]
            raise ImportRefused(
                f"{where}.{name}[{bad}]: {value} is not an id of the service's tokenizer (0 to {vocab_size - 1})"
            )
    bad = next((k for k, m in enumerate(item.response_mask) if m not in (0, 1)), None)
    if bad is not None:
        raise ImportRefused(f"{where}.response_mask[{bad}]: {item.response_mask[bad]} is neither 0 nor 1")
    if 1 not in item.response_mask:
        raise ImportRefused(f"{where}.response_mask: no token of the policy's (no 1): nothing to train on")
    if item.token_versions is None:
        if item.policy_version is None:
            raise ImportRefused(f"{where}.policy_version: give it, or token_versions: which policy sampled the tokens")
        if item.policy_version > current_version:
            raise ImportRefused(
                f"{where}.policy_version: {item.policy_version} is newer than the service's {current_version}"
            )
        return
    for k, (mask, version) in enumerate(zip(item.response_mask, item.token_versions, strict=True)):
        if mask and (version is None or not 0 <= version <= current_version):
            raise ImportRefused(
                f"{where}.token_versions[{k}]: a policy token needs a version from 0 to the service's "
                f"{current_version}, not {version}"
            )


def _trajectory(item: ImportedTrajectory) -> Trajectory:
    versions = item.token_versions or [item.policy_version if m else None for m in item.response_mask]
    turns = _turns(item.response_mask, versions)
    sampled = [v for v, m in zip(versions, item.response_mask, strict=True) if m and v is not None]
    return Trajectory(
        job_id=item.job_id or f"import-{uuid.uuid4().hex}",
        task=item.task,
        instance_id=item.instance_id,
        prompt_ids=item.prompt_ids,
        response_ids=item.response_ids,
        response_mask=item.response_mask,
        response_logprobs=item.response_logprobs,
        turns=turns,
        num_turns=len(turns),
        finish_reason="finish",
        reward=item.reward,
        reward_components=item.reward_components,
        policy_version_min=min(sampled),
        policy_version_max=max(sampled),
        timings=StageTimings(),
        labels=item.labels,
        group=item.group,
    )


def _turns(mask: list[int], versions: list[int | None]) -> list[Turn]:
    """A turn per run of the policy's tokens, resumed where the version changes within it: so that
    `Trajectory.token_versions()` gives back `versions` (the trainer's and the staleness plugin's source)."""
    turns: list[Turn] = []
    k = 0
    while k < len(mask):
        if not mask[k]:
            k += 1
            continue
        start = k
        while k < len(mask) and mask[k]:
            k += 1
        span = versions[start:k]
        resumptions = [
            Resumption(offset=offset, policy_version=version)
            for offset, version in enumerate(span)
            if offset and version != span[offset - 1]
        ]
        turns.append(
            Turn(
                index=len(turns),
                policy_version=span[0],
                resumptions=resumptions,
                llm_server=IMPORTED_SERVER,
                response_start=start,
                response_tokens=k - start,
                finish_reason=None,
                text="",
            )
        )
    return turns
