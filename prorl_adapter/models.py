"""The rollout service's wire format: job requests, job status, and the trajectory a trainer consumes.

One module, shared by the service, its HTTP API, its clients and the training-backend plugins, so the
contract a trainer relies on is written down exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclass
class TrajectoryWeight:
    """A plugin's verdict on one trajectory when the trainer consumes it.

    `sample` multiplies the sample's loss (0 drops it); `tokens`, if given, multiplies each response token's
    loss (e.g. truncated importance weights), aligned with `response_ids`.
    """

    sample: float = 1.0
    tokens: list[float] | None = None
    reasons: list[str] = field(default_factory=list)

    @classmethod
    def combine(cls, weights: list[TrajectoryWeight | None], length: int) -> TrajectoryWeight:
        """Several plugins' verdicts on one trajectory of `length` response tokens: sample weights multiply,
        token weights multiply element-wise, reasons are kept in order."""
        combined = cls()
        for weight in weights:
            if weight is None:
                continue
            combined.sample *= weight.sample
            combined.reasons += weight.reasons
            if weight.tokens is not None:
                if len(weight.tokens) != length:
                    raise ValueError(f"a plugin returned {len(weight.tokens)} token weights for {length} tokens")
                base = combined.tokens or [1.0] * length
                combined.tokens = [a * b for a, b in zip(base, weight.tokens)]
        return combined


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Strict):
    """Per-turn generation settings, passed through to the OpenAI-compatible /v1/completions endpoint."""

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(256, gt=0, description="tokens per turn")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    # A regex the whole turn must match (vLLM structured outputs): makes a tiny model emit real tool calls.
    regex: str | None = None


class JobRequest(_Strict):
    """Body of POST /v1/jobs: one episode of one task instance."""

    job_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$", description="idempotency key")
    task: str = Field(description="the task handler, e.g. shell, python_math, swe")
    instance: dict[str, Any] = Field(default_factory=dict, description="the task instance, as the handler reads it")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    max_turns: int = Field(8, gt=0, le=1000)
    max_context_tokens: int = Field(4096, gt=0)
    timeout_s: float | None = Field(None, gt=0, description="budget for init + run + eval; queueing not counted")
    labels: dict[str, str] = Field(default_factory=dict)


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
FinishReason = Literal["finish", "max_turns", "max_context", "no_tool_call", "error"]


class JobError(BaseModel):
    error_class: ErrorClass
    message: str


class ToolCall(BaseModel):
    name: str
    arguments: dict[str, Any]


class Turn(BaseModel):
    """One policy turn and the tool results that followed it."""

    index: int
    policy_version: int
    llm_server: str
    response_tokens: int
    finish_reason: str | None
    text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    observation: str = ""
    observation_tokens: int = 0
    generate_s: float = 0.0
    tools_s: float = 0.0


class StageTimings(BaseModel):
    queued_s: float = 0.0
    init_s: float = 0.0
    run_s: float = 0.0
    eval_s: float = 0.0
    # Where run time went: waiting for the LLM vs running tools; the rest is orchestration.
    generate_s: float = 0.0
    tools_s: float = 0.0


class Trajectory(BaseModel):
    """A finished episode, as the trainer consumes it.

    `response_ids` holds every token after the prompt, the policy's and the tools' interleaved;
    `response_mask[i]` is 1 where the policy sampled token i and 0 where a tool result or template put it;
    `response_logprobs[i]` is the policy's logprob of token i (0.0 where the mask is 0).
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
    labels: dict[str, str] = Field(default_factory=dict)


class JobStatus(BaseModel):
    job_id: str
    task: str
    state: JobState
    submitted_at: float
    timings: StageTimings
    error: JobError | None = None
    attempts: int = 0


class LLMServerInfo(BaseModel):
    url: str
    healthy: bool
    in_flight: int
    requests: int
    failures: int


LLMServerURL = Annotated[str, Field(pattern=r"^https?://[^\s/]+(/\S*)?$", max_length=2048)]


class LLMServerRequest(_Strict):
    url: LLMServerURL


class LLMServersRequest(_Strict):
    """Body of PUT /v1/llm-servers: the whole set of LLM servers, replacing the current one at once."""

    urls: list[LLMServerURL] = Field(min_length=1)


class PolicyVersion(_Strict):
    version: int = Field(ge=0)
    # Several trainer workers publish the same steps, in no fixed order: with raise_only a late publisher
    # never moves the version back.
    raise_only: bool = False


class ProcessRequest(BaseModel):
    """ProRL Agent's request shape for POST /process, for users coming from it."""

    instance: dict[str, Any]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    job_id: str | None = None


class PromptsRequest(_Strict):
    """Body of POST /v1/prompts: upcoming episodes for decoupled mode, started as admission control allows."""

    requests: list[JobRequest] = Field(min_length=1)


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


class BatchItem(BaseModel):
    id: str
    deliveries: int
    weight: TrajectoryWeight
    trajectory: Trajectory


class Batch(BaseModel):
    items: list[BatchItem]
    policy_version: int
