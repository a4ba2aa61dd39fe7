"""Every type that crosses a boundary: the rollout service's HTTP API (job requests, job status, the trajectory
a trainer consumes, batches) and the hooks between the core and its plugins (weights, admission state).

One module, shared by the service, its clients, the hooks and the training-backend plugins, so the contract a
trainer relies on is written down exactly once. It imports nothing of the project.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


@dataclass
class TrajectoryWeight:
    """The plugins' verdict on one trajectory when the trainer consumes it (`prorl_trajectory_weight`).

    `sample` multiplies the sample's loss (0 drops it); `tokens`, if given, multiplies each response token's
    loss (e.g. truncated importance weights), aligned with `response_ids`.
    """

    sample: float = 1.0
    tokens: list[float] | None = None
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class AdmissionState:
    """What admission control sees before a new episode starts (`prorl_admit_episode`, decoupled mode), as
    counts by policy version: it costs O(versions), never O(episodes or trajectories)."""

    current_version: int
    in_flight: Mapping[int, int]  # policy version -> episodes running that started at it
    buffered: Mapping[int, int]  # oldest-turn version -> trajectories in the buffer (ready or leased)

    @property
    def running(self) -> int:
        return sum(self.in_flight.values())

    @property
    def pending(self) -> int:
        """Episodes that may still be consumed: running ones and buffered ones."""
        return self.running + sum(self.buffered.values())

    @property
    def oldest_version(self) -> int:
        """The oldest version among pending episodes and the one that would start now."""
        return min([self.current_version, *self.in_flight, *self.buffered])


def _from_earlier_labels(data: Any, group: bool) -> Any:
    """A job request or trajectory as an earlier version of the service wrote it (Redis outlives an upgrade) kept
    the service's metadata in labels: a retried prompt's run (`prorl_attempt`, `prorl_prompt`) and, in a
    trajectory, the GRPO group (`group`). Read back, it gets the typed fields; the labels stay as they were. Only
    where the field itself is absent: this version always writes it, so a label of a client's own is never read
    as one."""
    if not isinstance(data, dict) or not isinstance(labels := data.get("labels"), dict):
        return data
    update: dict[str, Any] = {}
    if group and "group" not in data and isinstance(labels.get("group"), str):
        update["group"] = labels["group"]
    if "attempt" not in data and str(labels.get("prorl_attempt", "")).isdigit():
        update["attempt"] = int(labels["prorl_attempt"])
        update["retry_of"] = labels.get("prorl_prompt")
    return {**data, **update} if update else data


class _Strict(BaseModel):
    # Unknown fields and values of the wrong JSON type (`"5"` for a number) are a client's mistakes: a 400.
    model_config = ConfigDict(extra="forbid", strict=True)


class _Query(BaseModel):
    # Query parameters arrive as strings: converted to the field's type, but no unknown parameter.
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Strict):
    """Per-turn generation settings, passed to the LLM server in its protocol (llm_protocols.py)."""

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(256, gt=0, description="tokens per turn")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    # A regex the whole turn must match (vLLM structured outputs): makes a tiny model emit real tool calls.
    regex: str | None = None


def _no_dots(path: str) -> str:
    if any(part in (".", "..") for part in path.split("/")):
        raise ValueError(f"{path!r}: no '.' or '..' in a file's path")
    return path


class AgentProgram(_Strict):
    """An agent harness of the user's own that runs the episode instead of the built-in agent loop: `command`
    runs in the episode's sandbox with `OPENAI_BASE_URL` and `OPENAI_API_KEY` (and `ANTHROPIC_BASE_URL` and
    `ANTHROPIC_API_KEY`) naming the episode's LLM gateway (docs/gateway.md), and `PRORL_TASK_PROMPT` the task's
    prompt. Init and eval are the task's as usual."""

    command: str = Field(min_length=1, max_length=64 * 1024, description="a bash command line, run in the sandbox")
    env: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")], str] = Field(
        default_factory=dict, description="more environment for the program"
    )
    files: dict[Annotated[str, Field(pattern=r"^/tmp(/[^/\x00]+)+$"), AfterValidator(_no_dots)], str] = Field(
        default_factory=dict,
        description="files written into the sandbox's /tmp at init, by path: the program's code where the image "
        "does not hold it",
    )


# How the built-in agent loop reads a policy turn's actions (prorl_adapter/service/actions.py): hermes
# `<tool_call>` JSON, or the last fenced code block (```bash, ```python, ```finish) as text harnesses write them.
ActionFormatName = Literal["hermes", "fenced"]


class JobRequest(_Strict):
    """Body of POST /v1/jobs: one episode of one task instance."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "task": "shell",
                    "instance": {"goal": "Create the file /workspace/done", "check": "test -f /workspace/done"},
                    "sampling": {"temperature": 1.0, "max_tokens": 64},
                    "max_turns": 4,
                }
            ]
        }
    )

    job_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$", description="idempotency key")
    task: str = Field(description="the task handler, e.g. shell, python_math, swe")
    instance: dict[str, Any] = Field(default_factory=dict, description="the task instance, as the handler reads it")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    max_turns: int = Field(8, gt=0, le=1000)
    max_context_tokens: int = Field(4096, gt=0)
    timeout_s: float | None = Field(None, gt=0, description="budget for init + run + eval; queueing not counted")
    labels: dict[str, str] = Field(
        default_factory=dict, description="the client's own tags, carried to the trajectory; the service reads none"
    )
    group: str | None = Field(
        None,
        max_length=256,
        description="the GRPO group: episodes of one prompt, which the trainer compares with each other (default: "
        "for num_samples > 1 the submission's job id, else the task and instance)",
    )
    attempt: int = Field(
        1,
        ge=1,
        le=1000,
        description="which run of its prompt this is: decoupled mode runs a prompt whose episode failed for the "
        "infrastructure again, under a job id of its own (`retry_of`); set by the service",
    )
    retry_of: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$", description="the job id of the prompt's first run (attempt > 1)"
    )
    outage_reruns: int = Field(
        0,
        ge=0,
        le=1000,
        description="of the runs before this one, those an LLM outage failed (`JobError.outage`): not counted against "
        "max_attempts; set by the service",
    )
    agent: AgentProgram | None = Field(
        None, description="run this program through the LLM gateway instead of the built-in agent loop"
    )
    num_samples: int = Field(
        1, ge=1, le=256, description="episodes of this instance, one GRPO group (their `group` is shared)"
    )
    action_format: ActionFormatName | None = Field(
        None,
        description="how the built-in loop reads the policy's actions: hermes <tool_call> JSON, or the last fenced "
        "code block of a turn (```bash, ```python, ```finish); default: the task's (hermes for the built-in tasks)",
    )

    @model_validator(mode="before")
    @classmethod
    def _earlier(cls, data: Any) -> Any:
        return _from_earlier_labels(data, group=False)  # a client's label named group is its own

    @model_validator(mode="after")
    def _sample_ids_fit(self) -> JobRequest:
        if self.job_id and self.num_samples > 1 and len(self.job_id) + len(f".{self.num_samples - 1}") > 128:
            raise ValueError(f"job_id is too long for {self.num_samples} samples: their ids <job_id>.<i> exceed 128")
        return self

    def samples(self) -> list[JobRequest]:
        """The episodes this request asks for: itself, or `num_samples` copies of one GRPO group. A copy's job id
        is the request's with `.i` appended (so a retried submission is idempotent), its `group` the request's
        own or the submission's id, and a given seed is varied per copy (the same seed would sample the same
        episode n times)."""
        if self.num_samples == 1:
            return [self]
        base = self.job_id or uuid.uuid4().hex
        copies = []
        for i in range(self.num_samples):
            seed = None if self.sampling.seed is None else self.sampling.seed + i
            update = {
                "job_id": f"{base}.{i}" if self.job_id else None,
                "num_samples": 1,
                "group": self.group or base,
                "sampling": self.sampling.model_copy(update={"seed": seed}),
            }
            copies.append(self.model_copy(update=update))
        return copies


class JobState(str, Enum):  # noqa: UP042 - StrEnum would change str(state), which logs and messages use
    queued = "queued"
    init = "init"
    running = "running"
    evaluating = "evaluating"
    done = "done"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.done, JobState.failed, JobState.cancelled)


ErrorClass = Literal["init", "run", "eval", "timeout", "cancelled"]
# `agent_exit`: an agent program (JobRequest.agent) ended; `agent_timeout`: it ran out of time and was stopped.
FinishReason = Literal["finish", "max_turns", "max_context", "no_tool_call", "error", "agent_exit", "agent_timeout"]


class JobError(BaseModel):
    error_class: ErrorClass
    message: str
    outage: bool = Field(
        False,
        description="an LLM outage failed it (no server healthy, or most requests failing), not the episode: decoupled "
        "mode runs its prompt again without counting the run against max_attempts",
    )


class ToolCall(BaseModel):
    name: str
    arguments: dict[str, Any]


class Resumption(BaseModel):
    """Where an interrupted turn went on: from its `offset`-th token (0: its first) the turn was sampled at
    `policy_version`. A turn is interrupted when its generation is aborted (a weight update's barrier in `abort`
    mode, or someone else's abort) and resumed from its prompt plus the tokens sampled so far."""

    offset: int = Field(gt=0)
    policy_version: int


class Turn(BaseModel):
    """One policy turn (for an agent program: one LLM gateway call) and the tool results that followed it. The
    policy's tokens of the turn are `response_ids[response_start : response_start + response_tokens]` of the
    trajectory's segment `segment` (0: the trajectory's own fields; k: `segments[k - 1]`). `policy_version`
    sampled its first token; where it was interrupted and resumed, `resumptions` say which version sampled the
    rest (`BatchItem.token_versions` gives every token's)."""

    index: int
    segment: int = 0
    policy_version: int
    resumptions: list[Resumption] = Field(default_factory=list)
    llm_server: str
    response_start: int = Field(ge=0)
    response_tokens: int
    finish_reason: str | None
    text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_errors: list[str] = Field(default_factory=list, description="why a call in `text` could not be parsed")
    observation: str = ""
    tool_results: list[str] = Field(
        default_factory=list,
        description="each result that followed the turn, one tool message each (the "
        "observation joins them); empty where the results were not appended to the context",
    )
    observation_tokens: int = 0
    generate_s: float = 0.0
    tools_s: float = 0.0

    def versions(self) -> list[int]:
        """Every policy version that sampled a token of the turn."""
        return [self.policy_version, *(r.policy_version for r in self.resumptions)]


class StageTimings(BaseModel):
    queued_s: float = 0.0
    init_s: float = 0.0
    run_s: float = 0.0
    eval_s: float = 0.0
    # Where run time went: waiting for the LLM vs running tools; the rest is orchestration.
    generate_s: float = 0.0
    tools_s: float = 0.0


class Segment(BaseModel):
    """One token sequence of an episode, trainable on its own: a prompt, then the policy's and the context's
    tokens interleaved (mask 1 where the policy sampled, 0 elsewhere), as in a Trajectory's own fields."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]


CutBudget = Literal["init_timeout", "run_timeout", "eval_timeout", "max_turns", "max_context", "agent_timeout"]


class BudgetCut(BaseModel):
    """What cut an episode short, and how far in: which budget, where it is set, its limit and what was used of it.
    A time budget of the job (`*_timeout`, by the stage it ran out in) fails the job (filtered); the others end
    the episode, which is graded as it stands."""

    budget: CutBudget
    setting: str = Field(
        description="where the limit is set: timeout_s (the job's; else the service's --timeout), max_turns, "
        "max_context_tokens, or the agent's own time (an agent program's share of the job's budget, a task's)"
    )
    limit: float | None = Field(
        description="the limit: seconds for a time budget, turns for max_turns, tokens for max_context; null "
        "where it is not known"
    )
    used: float = Field(
        description="how far in it was cut: seconds of the job's stage time (or of the agent's), turns taken, "
        "tokens in the context"
    )


class Trajectory(BaseModel):
    """A finished episode, as the trainer consumes it.

    `response_ids` holds every token after the prompt, the policy's and the tools' interleaved;
    `response_mask[i]` is 1 where the policy sampled token i and 0 where a tool result or template put it;
    `response_logprobs[i]` is the policy's logprob of token i (0.0 where the mask is 0).

    An agent program that rewrote its history (a summary, a truncation) made several token sequences: the first
    is in the trajectory's own fields, the others in `segments`, each with its own prompt (docs/gateway.md).
    Every sampled token is in exactly one of them; the reward is the episode's, shared by all.
    """

    job_id: str
    task: str
    instance_id: str | None = None
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    turns: list[Turn]
    num_turns: int
    finish_reason: FinishReason
    reward: float = 0.0
    reward_components: dict[str, float] = Field(default_factory=dict)
    policy_version_min: int
    policy_version_max: int
    timings: StageTimings
    error: JobError | None = None
    filter: bool = Field(False, description="True when the trainer should drop this sample (an infra failure)")
    labels: dict[str, str] = Field(default_factory=dict, description="the request's own tags")
    group: str | None = Field(None, description="the request's GRPO group, if it named one (BatchItem.group)")
    attempt: int = Field(1, description="which run of its prompt this episode was (decoupled mode's retries)")
    retry_of: str | None = Field(None, description="the job id of its prompt's first run, for attempt > 1")
    artifacts: dict[str, str] = Field(
        default_factory=dict, description="what the task's eval produced besides the reward (swe: git_patch)"
    )
    segments: list[Segment] = Field(
        default_factory=list, description="the episode's further token sequences, after the first (agent programs)"
    )
    prompt_messages: list[dict[str, Any]] = Field(
        default_factory=list,
        description="the chat messages the built-in agent loop rendered as `prompt_ids` (empty for an agent "
        "program: its gateway calls are recorded with their own messages)",
    )
    prompt_tools: list[dict[str, Any]] | None = Field(
        None, description="the tool schemas the chat template was given with `prompt_messages` (None: none)"
    )
    cut: BudgetCut | None = Field(None, description="the budget that cut the episode short, if one did")

    @model_validator(mode="before")
    @classmethod
    def _earlier(cls, data: Any) -> Any:
        return _from_earlier_labels(data, group=True)  # there, the group label was always the service's

    def token_versions(self) -> list[int | None]:
        """The policy version that sampled each response token of the first sequence, from each turn's span and
        its resumptions; None on tool and template tokens. A policy token outside every span (a trajectory rebuilt
        without turns) gets `policy_version_min`, the conservative answer."""
        versions: list[int | None] = [self.policy_version_min if m else None for m in self.response_mask]
        for turn in self.turns:
            if turn.segment != 0:
                continue  # its tokens are in another sequence (`BatchItem.segment_items` gives each its own turns)
            starts = [(0, turn.policy_version)] + [(r.offset, r.policy_version) for r in turn.resumptions]
            ends = [offset for offset, _ in starts[1:]] + [turn.response_tokens]
            for (offset, version), end in zip(starts, ends):
                first = turn.response_start + offset
                last = min(turn.response_start + end, len(versions))
                versions[first:last] = [version] * max(0, last - first)
        return versions

    def all_segments(self) -> list[Segment]:
        """Every token sequence of the episode, the trajectory's own first."""
        own = Segment(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            response_mask=self.response_mask,
            response_logprobs=self.response_logprobs,
        )
        return [own, *self.segments]


class JobStatus(BaseModel):
    job_id: str
    task: str
    state: JobState
    submitted_at: float
    timings: StageTimings
    error: JobError | None = None
    attempts: int = 0
    samples: list[str] = Field(
        default_factory=list, description="a submission with num_samples > 1: the job id of every sample, this first"
    )
    replica: str | None = Field(None, description="the service replica running it (shared state: Redis)")


# The wire formats an LLM server may speak (service/llm_protocols.py); a URL may name one: `sglang+http://...`.
LLM_PROTOCOLS = ("openai", "sglang", "prorl")


class LLMServerInfo(BaseModel):
    url: str
    protocol: Literal[LLM_PROTOCOLS] | None = Field(
        description="the wire format it speaks: named by its URL (`sglang+http://...`) or probed; null until known"
    )
    healthy: bool
    in_flight: int
    requests: int
    failures: int


class LLMOutage(BaseModel):
    """No episode can generate (docs/reliability.md): turns wait for a server (--llm-outage-wait-s) and, in decoupled
    mode, admission pauses."""

    reason: str = Field(
        description="no LLM server configured, none healthy, or an error-rate spike (most recent requests failed)"
    )
    since: float = Field(description="when it began (Unix time)")
    waiting: int = Field(0, description="turns waiting for a healthy server now")


def _parsable_url(url: str) -> str:
    """A URL whose host and port parse (the pattern alone lets `http://[::1` through)."""
    try:
        parts = urlsplit(url)  # a scheme that names a protocol (`sglang+http`) parses as one
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError as exc:
        raise ValueError(f"not a usable URL: {exc}") from None
    if not parts.hostname:
        raise ValueError("the URL names no host")
    return url


# An LLM server's base URL, optionally naming its protocol: `http://gpu-0:8000` (probed: vLLM's OpenAI API, SGLang
# or ProRL's /generate), `sglang+http://gpu-0:30000`, `prorl+http://...`, `openai+http://...`. A trailing /v1 is
# the same server.
LLMServerURL = Annotated[
    str,
    Field(
        pattern=rf"^(({'|'.join(LLM_PROTOCOLS)})\+)?https?://[^\s/\x00-\x1f\x7f]+(/[^\s\x00-\x1f\x7f]*)?$",
        max_length=2048,
    ),
    AfterValidator(_parsable_url),
]


class LLMServerRequest(_Strict):
    url: LLMServerURL


class LLMServersRequest(_Strict):
    """Body of PUT /v1/llm-servers: the whole set of LLM servers, replacing the current one at once."""

    urls: list[LLMServerURL] = Field(min_length=1)


class PolicyVersion(_Strict):
    version: int = Field(ge=0, le=2**63 - 1)
    # Several trainer workers publish the same steps, in no fixed order: with raise_only a late publisher
    # never moves the version back.
    raise_only: bool = False


MAX_PROMPTS_PER_CALL = 65536


class PromptsRequest(_Strict):
    """Body of POST /v1/prompts: upcoming episodes for decoupled mode, started as admission control allows."""

    requests: list[JobRequest] = Field(min_length=1)

    @model_validator(mode="after")
    def _bounded(self) -> PromptsRequest:
        episodes = sum(r.num_samples for r in self.requests)
        if episodes > MAX_PROMPTS_PER_CALL:
            raise ValueError(f"{episodes} episodes in one call (num_samples counted); at most {MAX_PROMPTS_PER_CALL}")
        return self


class BatchRequest(_Strict):
    """Body of POST /v1/batches: take up to `size` buffered trajectories, waiting up to `timeout_s`."""

    size: int = Field(gt=0, le=65536)
    timeout_s: float | None = Field(None, ge=0)
    lease_s: float | None = Field(
        None, gt=0, le=7 * 86400, description="acknowledge within this long, or the entries are delivered again"
    )
    # The trainer's logprobs of each entry's response tokens, by entry id (importance weighting).
    current_logprobs: dict[str, list[float]] = Field(default_factory=dict)


class AckRequest(_Strict):
    ids: list[str] = Field(min_length=1)


class ImportedTrajectory(_Strict):
    """One trajectory to put into the experience buffer as if this service had made it: recorded by a past run
    (`prorl-rollout import`) or made elsewhere. The policy's tokens need a version (`token_versions`, or one
    `policy_version` for all): the staleness plugin weighs an imported trajectory by it like any other."""

    job_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$", description="its id in the buffer's items (default: a new one)"
    )
    task: str = Field("imported", min_length=1, max_length=200)
    instance_id: str | None = None
    prompt_ids: list[int] = Field(min_length=1)
    response_ids: list[int] = Field(min_length=1)
    response_mask: list[int] = Field(description="1: sampled by the policy; 0: a tool's or the template's")
    response_logprobs: list[float] = Field(description="the sampling policy's logprob of each token (0.0 at mask 0)")
    token_versions: list[int | None] | None = Field(
        None, description="the policy version that sampled each response token (null at mask 0)"
    )
    policy_version: int | None = Field(None, ge=0, description="the version of every policy token, for short")
    reward: float
    reward_components: dict[str, float] = Field(default_factory=dict)
    group: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,256}$", description="its GRPO group")
    labels: dict[str, str] = Field(default_factory=dict)


class ImportRequest(_Strict):
    """Body of POST /v1/trajectories: put trajectories into the experience buffer, all of them or none."""

    trajectories: list[ImportedTrajectory] = Field(min_length=1, max_length=4096)
    group_sizes: dict[str, int] | None = Field(
        None,
        description="each group's size: a trajectory must name one of these groups, and each group must come "
        "whole (a GRPO trainer never sees half a group); null: groups are not checked",
    )


class TrajectoriesImported(BaseModel):
    imported: int
    ids: list[str] = Field(description="their entries in the buffer, in the order given")
    job_ids: list[str]


class BatchItem(BaseModel):
    """One weighed trajectory as a trainer consumes it: from the service's buffer (`id` is the entry to
    acknowledge, `deliveries` counts deliveries) or from a coupled run (`id` is the job id). What a trainer
    derives from it (loss weights, per-token versions, its GRPO group) is here, so every backend derives alike.
    """

    id: str
    deliveries: int = 1
    weight: TrajectoryWeight = Field(default_factory=TrajectoryWeight)
    trajectory: Trajectory

    @property
    def group(self) -> str:
        """GRPO compares the samples of one prompt: the request's `group`, else the task instance."""
        t = self.trajectory
        return t.group or f"{t.task}:{t.instance_id or t.job_id}"

    @property
    def trainable(self) -> bool:
        """False when no trainer may learn from this sample: a plugin weighed it 0 (e.g. too stale) or the
        service flagged the episode as an infrastructure failure (`Trajectory.filter`). Trainers that need a
        fixed batch size keep such a sample with an all-zero mask instead of dropping it."""
        return self.weight.sample != 0.0 and not self.trajectory.filter

    def loss_weights(self) -> list[float]:
        """Per response token: the sample weight times the token weight (tool and template tokens included;
        the response mask, not this, keeps them out of the loss)."""
        tokens = self.weight.tokens or [1.0] * len(self.trajectory.response_ids)
        return [self.weight.sample * w for w in tokens]

    def weighted_mask(self) -> list[float]:
        """The response mask times the loss weights, all zeros unless `trainable`: for a trainer whose loss
        multiplies each token's loss by a float mask (SkyRL's `loss_mask`)."""
        if not self.trainable:
            return [0.0] * len(self.trajectory.response_ids)
        return [m * w for m, w in zip(self.trajectory.response_mask, self.loss_weights())]

    def token_versions(self) -> list[int | None]:
        """The policy version that sampled each response token (`Trajectory.token_versions`)."""
        return self.trajectory.token_versions()

    def segment_items(self) -> list[BatchItem]:
        """One item per token sequence of the episode (`Trajectory.segments`: an agent program that rewrote its
        history), each with its sequence in the trajectory's own fields and its own turns, in the episode's
        order. All carry the episode's reward, group and sample weight: a trainer computes the episode's
        advantage once and gives it to every sequence. Per-token weights, aligned with the first sequence, stay
        with it. An item of one sequence is itself."""
        t = self.trajectory
        if not t.segments:
            return [self]
        items = []
        for k, segment in enumerate(t.all_segments()):
            turns = [turn.model_copy(update={"segment": 0}) for turn in t.turns if turn.segment == k]
            own = t.model_copy(update={**dict(segment), "turns": turns, "segments": []})
            weight = self.weight if k == 0 else replace(self.weight, tokens=None)
            items.append(self.model_copy(update={"trajectory": own, "weight": weight}))
        return items

    def one_sequence(self) -> BatchItem:
        """For a trainer that takes one token sequence per episode (verl 0.9.1's agent loop, SkyRL without
        step-wise trajectories): the item's sequence with the most policy tokens, the first of equals. The
        others are not trained on; `dropped_policy_tokens` counts their tokens."""
        return max(self.segment_items(), key=lambda i: sum(i.trajectory.response_mask))

    @property
    def dropped_policy_tokens(self) -> int:
        """Policy tokens `one_sequence` leaves out."""
        return sum(sum(s.response_mask) for s in self.trajectory.all_segments()) - sum(
            self.one_sequence().trajectory.response_mask
        )

    def truncated(self, max_response_tokens: int) -> BatchItem:
        """The item cut to a trainer's fixed response length. The reward stays on the (new) last token: an
        episode longer than the trainer's window is still scored as a whole."""
        t, n = self.trajectory, max_response_tokens
        if len(t.response_ids) <= n:
            return self
        cut = t.model_copy(
            update={
                "response_ids": t.response_ids[:n],
                "response_mask": t.response_mask[:n],
                "response_logprobs": t.response_logprobs[:n],
            }
        )
        tokens = self.weight.tokens[:n] if self.weight.tokens is not None else None
        return self.model_copy(update={"trajectory": cut, "weight": replace(self.weight, tokens=tokens)})


class Batch(BaseModel):
    items: list[BatchItem]
    policy_version: int


# -- replies of the smaller operations and the query parameters of the HTTP API ---------------------------
class ServiceHealth(BaseModel):
    ok: bool
    version: str
    degraded: str | None = Field(description="what does not work now (e.g. the buffer) and why; null when all does")


class RuntimeState(BaseModel):
    """A sandbox runtime as this replica sees it: given with --sandbox-url (`static`), or heard from."""

    name: str
    url: str
    source: Literal["static", "registered"]
    alive: bool = Field(description="sandboxes are placed on it (a registered one: heard from lately)")
    capacity: int | None = Field(description="the most sandboxes it holds (registered ones say)")
    sandboxes: int | None = Field(description="sandboxes it holds, as it last said")
    placed: int = Field(description="sandboxes of this replica's episodes on it now")
    failures: int = Field(description="sandboxes it failed to create for this replica")
    seen_s_ago: float | None = Field(description="seconds since its last heartbeat")
    creating: int = Field(0, description="this replica's sandbox creations in flight on it now (warm ones too)")
    creations_waiting: int = Field(
        0, description="creations held back by --max-concurrent-creates, episodes' and refills' together"
    )
    max_concurrent_creates: int | None = Field(
        None, description="the most creations in flight on it at once (--max-concurrent-creates; null: no limit)"
    )


class RuntimeStateList(BaseModel):
    runtimes: list[RuntimeState]


class ReplicaState(BaseModel):
    id: str
    url: str | None
    alive: bool
    seen_s_ago: float
    figures: dict[str, Any] = Field(default_factory=dict, description="its jobs in flight, episodes per second")


class RuntimeRegistered(BaseModel):
    name: str
    alive: bool = Field(description="whether sandboxes may be placed on it now (false after `leaving`)")


class WarmSandboxState(BaseModel):
    """The warm sandboxes of one sandbox spec (`--warm-sandboxes`), since the spec was first asked for."""

    image: str | None = Field(description="the spec's image")
    size: int = Field(description="the most warm sandboxes kept for it, ready or being created (--warm-sandboxes)")
    refill_per_s: float = Field(
        description="the most creations refills start per second, this spec's and the others' together "
        "(--warm-refill-per-s)"
    )
    ready: int = Field(description="warm sandboxes ready to be handed out now")
    creating: int = Field(description="warm sandboxes being created (or waiting to be)")
    hits: int = Field(description="episodes that got a warm sandbox")
    misses: int = Field(description="episodes that created their own")
    created: int = Field(description="warm sandboxes created")
    expired: int = Field(description="warm sandboxes deleted unused: too old, too short a TTL, or their runtime gone")
    failures: int = Field(description="warm sandboxes that could not be created")
    paused: bool = Field(description="refills stopped (one failed or found no room) until an episode asks again")
    saved_s: float = Field(description="creation time the hits saved: hits times a warm creation's mean time")


class EngineLoad(BaseModel):
    """One LLM server as the adaptive run concurrency (`--target-engine-batch`) last saw it."""

    url: str = Field(description="the server, as GET /v1/llm-servers names it")
    source: Literal["pending", "metrics", "fixed", "unhealthy"] = Field(
        description="where its share comes from: its engine metrics, the fixed share (no usable /metrics), nothing "
        "(unhealthy), or not read yet (pending)"
    )
    running: float | None = Field(description="requests in its engine batch (vllm:num_requests_running), last read")
    waiting: float | None = Field(description="requests in its engine queue (vllm:num_requests_waiting), last read")
    waiting_for_capacity: float | None = Field(
        description="of those, the ones waiting for the engine's capacity, not deferred by it (vLLM's "
        'num_requests_waiting_by_reason{reason="capacity"}; all of them from a vLLM that gives no reasons)'
    )
    share: int = Field(description="episodes of the run stage's limit this server accounts for")
    note: str | None = Field(None, description="why it is not on its metrics: what its /metrics answered")


class RunConcurrencyState(BaseModel):
    """How many episodes the run stage may hold at once, and why."""

    mode: Literal["fixed", "adaptive"] = Field(description="adaptive with --target-engine-batch; else fixed")
    limit: int = Field(description="episodes the run stage may hold at once now")
    held: int = Field(description="episodes it holds now")
    target_engine_batch: int | None = Field(description="the engine batch aimed at per server (adaptive)")
    min: int = Field(description="--min-run-workers (adaptive); --max-run-workers when fixed")
    max: int = Field(description="--max-run-workers")
    servers: list[EngineLoad] = Field(default_factory=list, description="each LLM server's load (adaptive)")


class InitGateState(BaseModel):
    """Back-pressure between init and run: sandboxes are made only while the run stage can take their episodes."""

    bound: int = Field(
        description="the most jobs ahead of the run stage, in it and waiting for eval, together: its limit + margin"
    )
    margin: int = Field(description="--init-ahead: jobs made ready beyond the run stage's limit")
    ahead: int = Field(description="jobs taken by init and not yet in the run stage (each holds or makes a sandbox)")
    running: int = Field(description="episodes in the run stage")
    waiting_for_eval: int = Field(description="episodes run and waiting for an eval worker, holding their sandboxes")
    waiting: int = Field(description="init workers waiting for room")


class BreakerTally(BaseModel):
    """The circuit breaker's count for one policy version: its finished episodes, and those it flagged."""

    version: int = Field(description="the policy version (a trajectory's policy_version_max)")
    episodes: int = Field(description="finished episodes of this version in which the policy acted (not cancelled)")
    flagged: int = Field(description="of those, the episodes with at least one signal the breaker weighs")
    signals: dict[str, int] = Field(
        description="episodes by signal, weighed or not: tampered, sandbox_limits, refused (one may have several)"
    )


class BreakerState(BaseModel):
    """The circuit breaker (docs/rollout.md): whether it holds admission back, and why."""

    enabled: bool = Field(description="--breaker-threshold is set (off by default)")
    tripped: bool = Field(description="admission is paused: POST /v1/jobs answers 503 and no queued prompt starts")
    version: int | None = Field(None, description="the policy version whose episodes tripped it")
    reason: str | None = Field(None, description="why it tripped, with the counts")
    tripped_at: float | None = Field(None, description="when it tripped, seconds since the epoch")
    tally: BreakerTally | None = Field(None, description="the count that tripped it, as it was then")
    threshold: float | None = Field(None, description="the share of flagged episodes that trips it")
    min_episodes: int = Field(description="episodes of one version counted before its share is weighed")
    signals: list[str] = Field(description="the signals it weighs")
    trips: int = Field(0, description="times it tripped since the service started")
    versions: list[BreakerTally] = Field(
        default_factory=list, description="the counts since the last reset, the newest versions first (at most 8)"
    )


class ServiceStatus(BaseModel):
    policy_version: int
    queues: dict[str, int] = Field(description="jobs waiting for each stage's workers: init, run, eval")
    active: dict[str, int] = Field(description="unfinished jobs by state")
    finished: dict[str, int] = Field(description="finished jobs by final state, since the service started")
    episodes_per_s_last_60s: float
    workers: dict[str, int] = Field(description="each stage's worker count")
    run_concurrency: RunConcurrencyState | None = Field(
        None, description="the run stage's limit on episodes in flight (null from a service without one)"
    )
    init_gate: InitGateState | None = Field(
        None, description="back-pressure from the run stage on init (null from a service without one)"
    )
    llm_servers: list[LLMServerInfo]
    llm_outage: LLMOutage | None = Field(None, description="why no episode can generate now; null while one can")
    degraded: str | None
    gateway_address: str | None = Field(
        None, description="HOST:PORT at which the sandbox runtimes reach the LLM gateway (agent programs)"
    )
    replica: str = Field("", description="this replica's id (--service-id)")
    replicas: list[ReplicaState] = Field(
        default_factory=list, description="every replica sharing this one's state (itself alone with memory://)"
    )
    runtimes: list[RuntimeState] = Field(default_factory=list, description="the sandbox runtimes this replica may use")
    warm_sandboxes: dict[str, WarmSandboxState] = Field(
        default_factory=dict,
        description="warm sandboxes by spec (a digest of its canonical JSON), most recently asked first; empty "
        "without --warm-sandboxes",
    )
    breaker: BreakerState | None = Field(None, description="the circuit breaker (null from a service without one)")


class TaskList(BaseModel):
    tasks: list[str]


class PluginInfo(BaseModel):
    name: str
    plugin: str = Field(description="the plugin's class or module name; `blocked` for a blocked one")
    hooks: list[str]


class PluginList(BaseModel):
    plugins: list[PluginInfo]
    config: dict[str, Any] = Field(description="the plugin configuration the service runs with, by section")


class LLMServerList(BaseModel):
    servers: list[LLMServerInfo]


class LLMServerRemoved(BaseModel):
    url: str
    removed: bool = Field(description="false when it was not there (removing is idempotent)")


class LLMServerQuery(_Query):
    """Query of DELETE /v1/llm-servers."""

    url: LLMServerURL


class WaitQuery(_Query):
    """Query of GET /v1/jobs/{id}/result: long-poll up to `wait` seconds for the result."""

    wait: float = Field(0.0, ge=0, le=3600, allow_inf_nan=False, description="seconds to wait for the result")


class PolicyVersionSet(BaseModel):
    version: int = Field(description="the version in effect after the call")


WeightUpdateMode = Literal["drain", "abort", "keep"]


class WeightUpdatePause(_Strict):
    """Body of POST /v1/weight-update/pause."""

    mode: WeightUpdateMode = Field(
        "drain",
        description="drain: the requests in flight finish with the old weights; abort: they are aborted at the LLM "
        "servers and resumed after the resume (vLLM and SGLang only); keep: they are frozen at the LLM servers and go "
        "on at the resume (vLLM, with the service started with --llm-stream)",
    )
    timeout_s: float = Field(
        600.0, gt=0, le=86400, allow_inf_nan=False, description="the barrier ends by itself this long after the pause"
    )


class WeightUpdateResume(_Strict):
    """Body of POST /v1/weight-update/resume."""

    version: int | None = Field(None, ge=0, le=2**63 - 1, description="the new weights' policy version, if it changed")
    raise_only: bool = False


class WeightUpdateState(BaseModel):
    paused: bool
    barrier: str | None = Field(description="the barrier's id while one holds")
    mode: WeightUpdateMode | None
    paused_at: float | None = Field(description="when it was taken (seconds since the epoch)")
    expires_in_s: float | None = Field(description="when it ends by itself unless resumed")
    in_flight: int = Field(description="generation requests in flight at this replica")
    waiting: int = Field(description="generation requests held at this replica's gate (new turns, interrupted ones)")
    policy_version: int
    pauses: int = Field(description="barriers taken at this replica since it started")
    expired: int = Field(description="barriers that ended by their timeout here (a trainer that never resumed)")
    last_expired_at: float | None


class PromptsQueued(BaseModel):
    upcoming: int = Field(description="prompts waiting to be admitted, these included")


class Acknowledged(BaseModel):
    acknowledged: int = Field(description="entries acknowledged by this call (unknown or acknowledged ones: 0)")


class ProducerStats(BaseModel):
    """The decoupled producer's figures (GET /v1/buffer): counts since the service started, or now."""

    upcoming: int = Field(0, description="prompts waiting to be admitted")
    in_flight: int = Field(0, description="episodes admitted and running")
    held_back: bool = False
    held_back_reason: str | None = None
    produced: int = Field(0, description="trajectories put in the buffer")
    imported: int = Field(0, description="trajectories put in the buffer by POST /v1/trajectories")
    filtered: int = Field(
        0, description="episodes that failed (infrastructure) max_attempts times, or were cancelled: not buffered"
    )
    retried: int = Field(0, description="failed episodes whose prompt was queued to run again")
    outage_reruns: int = Field(
        0, description="of those, episodes an LLM outage failed: their run not counted against max_attempts"
    )
    dropped: int = Field(0, description="trajectories weighed 0 when taken (too stale)")
    expired: int = Field(0, description="trajectories removed before a take: no plugin would weigh them above 0")
    leased: int = Field(0, description="entries taken and not yet acknowledged")
    redelivered: int = Field(0, description="entries whose lease ran out, handed back to be taken again")
    dead_letters: int = Field(0, description="entries whose lease ran out after max_deliveries: removed")
    admission_lock_lapses: int = Field(
        0, description="admissions refused because the shared admission lock expired while they were decided"
    )
    undelivered: int = Field(0, description="finished trajectories waiting for the buffer to come back")
    degraded: str | None = Field(None, description="why the buffer or the prompt queue cannot be used now")
    versions_in_flight: list[int] = Field(default_factory=list)
    recent_dead_letters: list[str] = Field(default_factory=list)


class BufferStatus(ProducerStats):
    """GET /v1/buffer: the buffer's counts (null while it cannot be read: `degraded` says why) and the
    producer's figures. The producer's `expired` counts removals it made; the buffer's is named `buffer_expired`."""

    ready: int | None = Field(description="entries waiting to be taken")
    pending: int | None = Field(description="entries taken, not yet acknowledged")
    acked: int | None = Field(description="entries acknowledged in total")
    buffer_expired: int | None = Field(description="entries the buffer removed as expired, in total")


# -- the rollout viewer's reads (GET /viewer, docs/viewer.md) ---------------------------------------------
class JobsQuery(_Query):
    """Query of GET /v1/jobs: which of the jobs kept to list, newest first."""

    state: JobState | None = Field(None, description="only jobs in this state")
    task: str | None = Field(None, max_length=200, description="only jobs of this task")
    limit: int = Field(100, ge=1, le=10_000, description="at most this many jobs")


class JobSummary(BaseModel):
    """One job as the viewer's list shows it: what it ran, how it ended and what it was worth. The fields of its
    trajectory are null until it has finished."""

    job_id: str
    task: str
    state: JobState
    submitted_at: float | None = Field(description="seconds since the epoch (null for a record: see recorded_at)")
    recorded_at: float | None = Field(None, description="when its record was written (records only)")
    timings: StageTimings
    reward: float | None = None
    reward_components: dict[str, float] = Field(default_factory=dict)
    num_turns: int | None = None
    finish_reason: str | None = None
    policy_version_min: int | None = None
    policy_version_max: int | None = None
    staleness: int | None = Field(
        None, description="JobList.policy_version less policy_version_min: how many versions behind it is"
    )
    error_class: str | None = None
    error: str | None = Field(None, description="the error's message")
    filter: bool | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    group: str | None = None
    attempt: int = 1


class JobList(BaseModel):
    jobs: list[JobSummary] = Field(description="newest first")
    matched: int = Field(description="jobs kept that match the query, the limit aside")
    policy_version: int | None = Field(
        description="the version staleness is counted from: the service's current one (records: the newest they hold)"
    )
    source: str = Field(description="`live` (this replica's jobs) or `records of DIR`")


class TokenSequence(BaseModel):
    """One token sequence of a trajectory as text: each id's piece, so that the pieces concatenate to the decoded
    sequence (a character split across tokens is on its last token, the others' pieces empty)."""

    prompt: list[str] | None = Field(description="a piece per prompt id; null without a tokenizer")
    response: list[str] | None = Field(description="a piece per response id; null without a tokenizer")
    versions: list[int | None] = Field(description="the policy version that sampled each response token, else null")


class TrajectoryTokens(BaseModel):
    """GET /v1/jobs/{id}/tokens: the token view of a finished job's trajectory (its ids, mask and logprobs are in
    GET /v1/jobs/{id}/result)."""

    job_id: str
    tokenizer: str | None = Field(description="the tokenizer that made the pieces; null: none, the ids are shown")
    sequences: list[TokenSequence] = Field(description="the trajectory's own sequence first, then its segments")
