"""ProRL Agent's legacy rollout API, served beside /v1 by the same pipeline, so that its clients (NeMo Gym's
`prorl_agent`, NeMo-RL's OpenHands environment) run unchanged against this service.

The calls and their shapes follow ProRL-Agent-Server's `scripts/start_server.py`: `/start` and `/stop` switch the
API on and off (as they start and stop ProRL's worker process), `/process` blocks until its episode is done and
answers ProRL's result (`messages` with per-message token ids, `resolved`, `critical_error`, `timing`, ...),
built here from the episode's token-level trajectory. docs/compat.md says what maps to what and what differs.

An episode of `/process` is an ordinary job of the pipeline: nothing here runs an episode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server_kit.errors import ProrlError
from server_kit.openapi import Operation, Reply, describe_validation
from server_kit.webapp import json_response

from ..models import JobRequest, JobState, LLMServerURL, SamplingParams, Trajectory
from ..tasks import TaskConfigError, TaskHandler
from .chat import ChatTokenizer
from .job_runner import JobRunner, RunnerJob
from .llm import LLMPool

log = logging.getLogger(__name__)

# What ProRL does without a data_source, and without max_iterations (its registry's agent default).
DEFAULT_DATA_SOURCE = "swebench"
DEFAULT_MAX_ITERATIONS = 2
RESOLVED_ABOVE = 0.99  # ProRL's reward server: resolved = score > 0.99
NOT_RUNNING = "Server is not running. Please start the server first."

# sampling_params: what each key becomes here. This service's own sampling keys (max_tokens, stop, regex) are
# taken too. Keys of ProRL's LLM and agent configuration that have no counterpart here are accepted and have no
# effect (NOT_APPLICABLE); any other key is listed in the job's log and labels (`prorl_ignored`), never dropped
# silently.
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "max_output_tokens": "max_tokens",
    "max_tokens": "max_tokens",
    "stop": "stop",
    "regex": "regex",
}
JOB_KEYS = {"max_iterations": "max_turns", "max_model_len": "max_context_tokens"}
NOT_APPLICABLE = frozenset(
    {
        "model",  # the service samples from its own LLM servers
        "api_key",
        "custom_tokenizer",  # the service has its tokenizer (--tokenizer)
        "token_level_generation",  # always: every message carries its token ids
        "native_tool_calling",
        "modify_params",
        "log_completions",
        "drop_params",
        "timeout",  # an LLM request's; the job's budget is the service's --timeout
        "num_retries",  # the pool retries and fails over by itself
        "enable_thinking",
        "ensure_thinking_end_properly",
        "strict_loop_detector",
        "is_reasoning_task",
        "enable_vision",
        "enable_a11y_tree",
        "caching_prompt",
        "max_message_chars",
        "custom_llm_provider",
        "reasoning_effort",
        "max_input_tokens",
    }
)


# -- the wire format --------------------------------------------------------------------------------------
class _Lenient(BaseModel):
    # ProRL's server ignores keys it does not know; a client sending more than this must keep working.
    model_config = ConfigDict(extra="ignore")


class ProRLProcessRequest(_Lenient):
    """Body of POST /process."""

    instance: dict[str, Any] = Field(
        description="the task row; `data_source` names the task or a ProRL dataset (swebench, deepscaler), "
        "default swebench"
    )
    sampling_params: dict[str, Any] = Field(default_factory=dict, description="docs/compat.md maps each key")
    job_id: str | int | None = Field(
        None, description="ProRL's name for the call, for /cancel; several calls may share one (samples of one row)"
    )


class ProRLAddress(_Lenient):
    address: LLMServerURL = Field(description="`http://host:port`, with or without /v1; or `sglang+http://...`")


class ProRLCancel(_Lenient):
    job_id: str | int


class ProRLReply(BaseModel):
    status: str


class ProRLDetail(BaseModel):
    """ProRL's error body (FastAPI's)."""

    detail: str


class ProRLStatus(BaseModel):
    status: Literal["running"] = "running"
    pending_jobs: int = Field(description="/process calls waiting for their episode")
    running: bool = True
    jobs: int = Field(description="unfinished jobs of the service")
    init: int = Field(description="jobs queued or in init")
    run: int
    eval: int


class ProRLToolCall(BaseModel):
    name: str
    arguments: str = Field(description="the call's arguments as a JSON string")


class ProRLMessage(BaseModel):
    """One chat message with its token ids: joined in order, every message's `token_ids` are the episode's
    prompt and response ids exactly."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ProRLToolCall] | None = Field(None, exclude_if=lambda calls: calls is None)
    token_ids: list[int] = Field(description="assistant: the sampled ids; others: their template-rendered ids")
    input_ids: list[int] | None = Field(description="assistant: the whole prompt of its LLM call; others: null")
    logprobs: list[float] | None = Field(description="assistant: one per sampled id; others: null")


class ProRLTiming(BaseModel):
    init_time: float
    run_time: float
    eval_time: float
    others_time: float = Field(description="waiting in queues")
    counted_elapsed: float = Field(description="init + run + eval: what the job's budget counts")
    timeout_triggered: bool


class ProRLResult(BaseModel):
    instance_id: str | None
    trajectory_id: Any = None
    job_id: str = Field(description="this service's job id (GET /v1/jobs/{id}), not ProRL's")
    messages: list[ProRLMessage] = Field(description="empty when no turn was sampled (ProRL's clients retry then)")
    tools: list[dict[str, Any]] = Field(description="the agent's tools, as OpenAI function schemas")
    resolved: bool = Field(description="the task's own outcome passed (reward_components.outcome > 0.99)")
    success: bool = Field(description="the episode ended without an error")
    finish: bool = Field(description="the policy called `finish`")
    end_properly: bool = Field(description="the last turn was neither cut at its token limit nor a malformed call")
    git_patch: str | None = Field(None, description="the agent's changes as a unified diff, where the task makes one")
    error: str | None
    critical_error: Literal["init", "run", "eval", "timeout"] | None
    filter: bool
    timing: ProRLTiming


# -- the state ProRL's calls share ------------------------------------------------------------------------
CALLER_CHECK_S = 1.0


class CallerGone(ProrlError):
    """The client of a /process call closed its connection: nobody waits for the episode any more."""


class ProRLLegacy:
    """ProRL's server state over the job runner: whether it was started, and the /process calls in flight. It
    reads the service's tasks (to map data sources), LLM pool (ProRL's LLM server calls) and chat template (the
    result's messages), and waits up to twice the job budget (`budget_s`) for an episode, as ProRL's own
    coordinator does."""

    def __init__(
        self, runner: JobRunner, tasks: dict[str, TaskHandler], llm: LLMPool, chat: ChatTokenizer, budget_s: float
    ) -> None:
        self.runner = runner
        self.tasks = tasks
        self.llm = llm
        self.chat = chat
        self.budget_s = budget_s
        self.running = False
        self.calls: dict[str, set[str]] = defaultdict(set)  # ProRL job id -> our job ids in flight
        self.stopping: set[str] = set()  # our job ids cancelled by /stop: their calls answer 500

    def job_request_for(self, body: ProRLProcessRequest) -> JobRequest:
        """The job a /process call runs: data_source mapped to a task (its row adapted where the task knows the
        dataset), sampling_params mapped key by key. A row a task cannot serve is a 400 saying what is missing."""
        row = dict(body.instance)
        source = row.pop("data_source", None) or DEFAULT_DATA_SOURCE
        if not isinstance(source, str):
            raise web.HTTPBadRequest(text="instance.data_source must be a string (a task or a ProRL dataset name)")
        task, instance = self._task_and_instance(source, row)
        params = {key: value for key, value in body.sampling_params.items() if value is not None}  # null: default
        if "max_output_tokens" in params and "max_tokens" in params:
            raise web.HTTPBadRequest(text="sampling_params: give max_output_tokens or max_tokens, not both")
        if isinstance(params.get("stop"), str):  # one stop string, as OpenAI's API takes it
            params["stop"] = [params["stop"]]
        sampling = {ours: params.pop(theirs) for theirs, ours in SAMPLING_KEYS.items() if theirs in params}
        job = {ours: params.pop(theirs) for theirs, ours in JOB_KEYS.items() if theirs in params}
        job.setdefault("max_turns", DEFAULT_MAX_ITERATIONS)
        # Without a per-turn limit a turn may fill the context left, as in ProRL's token-level mode.
        sampling.setdefault(
            "max_tokens", job.get("max_context_tokens", JobRequest.model_fields["max_context_tokens"].default)
        )
        job_id = f"prorl-{uuid.uuid4().hex}"  # every call its own episode, whatever its ProRL job_id
        labels = {"prorl_data_source": source}
        if body.job_id is not None:
            labels["prorl_job_id"] = str(body.job_id)
        ignored = sorted(key for key in params if key not in NOT_APPLICABLE)
        if ignored:
            labels["prorl_ignored"] = ",".join(ignored)
            log.warning("job %s: sampling_params not used here: %s", job_id, labels["prorl_ignored"])
        try:
            return JobRequest(
                job_id=job_id, task=task, instance=instance, sampling=SamplingParams(**sampling), labels=labels, **job
            )
        except ValidationError as exc:
            raise web.HTTPBadRequest(text=f"invalid sampling_params: {describe_validation(exc)}") from None

    def _task_and_instance(self, source: str, row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        tasks = self.tasks
        if source in tasks:
            return source, row
        for name, handler in tasks.items():
            if source in handler.prorl_data_sources:
                try:
                    return name, handler.from_prorl_instance(source, row)
                except TaskConfigError as exc:
                    raise web.HTTPBadRequest(text=f"data_source {source!r} (task {name!r}): {exc}") from None
        known = sorted({*tasks, *(s for h in tasks.values() for s in h.prorl_data_sources)})
        raise web.HTTPBadRequest(text=f"data_source {source!r} has no task here; known: {', '.join(known)}")

    async def process(self, request: JobRequest, wait_s: float, caller_gone: Callable[[], bool]) -> RunnerJob:
        """Run the job to its end and return it. It is cancelled when `wait_s` passes (TimeoutError) and when the
        caller goes away (CallerGone): aiohttp does not cancel a handler whose client disconnects, so the call
        looks at its connection every CALLER_CHECK_S."""
        job, _ = self.runner.submit(request)
        name = request.labels.get("prorl_job_id", job.id)
        self.calls[name].add(job.id)
        deadline = time.monotonic() + wait_s
        try:
            while job.result is None:
                if caller_gone():
                    raise CallerGone(job.id)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(job.id)
                job = await self.runner.wait(job.id, min(left, CALLER_CHECK_S))
        except (asyncio.CancelledError, TimeoutError, CallerGone):
            await asyncio.shield(self.runner.cancel(job.id))
            raise
        finally:
            self.calls[name].discard(job.id)
            if not self.calls[name]:
                del self.calls[name]
        return job

    async def cancel(self, name: str) -> None:
        for job_id in list(self.calls.get(name, ())):
            await self.runner.cancel(job_id)

    async def stop(self) -> None:
        self.running = False
        for job_ids in list(self.calls.values()):
            for job_id in list(job_ids):
                self.stopping.add(job_id)
                await self.runner.cancel(job_id)

    def status(self) -> ProRLStatus:
        active = self.runner.status()["active"]
        return ProRLStatus(
            pending_jobs=sum(len(ids) for ids in self.calls.values()),
            jobs=sum(active.values()),
            init=active[JobState.queued.value] + active[JobState.init.value],
            run=active[JobState.running.value],
            eval=active[JobState.evaluating.value],
        )


# -- the result, from the trajectory ----------------------------------------------------------------------
async def prorl_result(
    job: RunnerJob, handler: TaskHandler, prorl_instance: dict[str, Any], chat: ChatTokenizer
) -> ProRLResult:
    t: Trajectory = job.result
    instance = job.request.instance
    try:
        tools = [tool.schema() for tool in handler.tools(instance)]
    except Exception:  # a row the handler could not read: there were no turns either
        tools = []
    messages = await _messages(t, handler, instance, tools, chat) if t.turns else []
    error_class = t.error.error_class if t.error is not None else None
    last = t.turns[-1] if t.turns else None
    timings = t.timings
    counted = timings.init_s + timings.run_s + timings.eval_s
    return ProRLResult(
        instance_id=None if prorl_instance.get("instance_id") is None else str(prorl_instance["instance_id"]),
        trajectory_id=prorl_instance.get("trajectory_id"),
        job_id=t.job_id,
        messages=messages,
        tools=tools,
        resolved=t.error is None and t.reward_components.get("outcome", 0.0) > RESOLVED_ABOVE,
        success=t.error is None,
        finish=t.finish_reason == "finish",
        end_properly=last is not None and last.finish_reason != "length" and not last.tool_call_errors,
        error=t.error.message if t.error is not None else None,
        critical_error=error_class if error_class in ("init", "run", "eval", "timeout") else None,
        filter=t.filter,
        git_patch=t.artifacts.get("git_patch"),
        timing=ProRLTiming(
            init_time=timings.init_s,
            run_time=timings.run_s,
            eval_time=timings.eval_s,
            others_time=timings.queued_s,
            counted_elapsed=counted,
            timeout_triggered=error_class == "timeout",
        ),
    )


async def _messages(
    t: Trajectory, handler, instance: dict[str, Any], tools: list[dict], chat: ChatTokenizer
) -> list[ProRLMessage]:
    """System, user, then each turn's assistant message and the tool message after it; a trailing tool message
    (the episode ended on its turn limit) is left out, as ProRL leaves it out."""
    system, user = handler.system_prompt(instance), handler.user_prompt(instance)
    system_ids = await chat.off_loop(chat.encode, chat.render([{"role": "system", "content": system}], tools, False))
    if t.prompt_ids[: len(system_ids)] != system_ids:  # a template that renders the system turn otherwise
        system_ids = []
    messages = [
        ProRLMessage(role="system", content=system, token_ids=system_ids, input_ids=None, logprobs=None),
        ProRLMessage(
            role="user", content=user, token_ids=t.prompt_ids[len(system_ids) :], input_ids=None, logprobs=None
        ),
    ]
    for index, turn in enumerate(t.turns):
        start, end = turn.response_start, turn.response_start + turn.response_tokens
        messages.append(
            ProRLMessage(
                role="assistant",
                content=turn.text,
                tool_calls=[ProRLToolCall(name=c.name, arguments=json.dumps(c.arguments)) for c in turn.tool_calls]
                or None,
                token_ids=t.response_ids[start:end],
                input_ids=t.prompt_ids + t.response_ids[:start],
                logprobs=t.response_logprobs[start:end],
            )
        )
        following = t.turns[index + 1].response_start if index + 1 < len(t.turns) else None
        if following is not None and following > end:
            messages.append(
                ProRLMessage(
                    role="tool",
                    content=turn.observation,
                    token_ids=t.response_ids[end:following],
                    input_ids=None,
                    logprobs=None,
                )
            )
    return messages


# -- the handlers -----------------------------------------------------------------------------------------
LEGACY = web.AppKey("prorl_legacy", ProRLLegacy)


def _refuse(status: int, detail: str) -> web.Response:
    return json_response(ProRLDetail(detail=detail), status=status)


async def prorl_start(request: web.Request) -> web.Response:
    legacy = request.app[LEGACY]
    if legacy.running:
        return _refuse(400, "Server is already running")
    legacy.running = True
    return json_response(ProRLReply(status="Server started successfully"))


async def prorl_stop(request: web.Request) -> web.Response:
    legacy = request.app[LEGACY]
    if not legacy.running:
        return _refuse(503, NOT_RUNNING)
    await legacy.stop()
    return json_response(ProRLReply(status="Server stopped successfully"))


async def prorl_status(request: web.Request) -> web.Response:
    legacy = request.app[LEGACY]
    if not legacy.running:
        return _refuse(503, NOT_RUNNING)
    return json_response(legacy.status())


async def prorl_add_llm_server(request: web.Request, body: ProRLAddress) -> web.Response:
    await request.app[LEGACY].llm.check(body.address)
    return json_response(ProRLReply(status=f"Added LLM server address: {body.address}"))


async def prorl_clear_llm_server(request: web.Request) -> web.Response:
    request.app[LEGACY].llm.replace([])
    return json_response(ProRLReply(status="Cleared all LLM server addresses"))


async def prorl_cancel(request: web.Request, body: ProRLCancel) -> web.Response:
    legacy = request.app[LEGACY]
    if not legacy.running:
        return _refuse(503, NOT_RUNNING)
    await legacy.cancel(str(body.job_id))
    return json_response(ProRLReply(status=f"Cancel requested for job {body.job_id}"))


async def prorl_process(request: web.Request, body: ProRLProcessRequest) -> web.Response:
    legacy = request.app[LEGACY]
    if not legacy.running:
        return _refuse(503, NOT_RUNNING)
    job_request = legacy.job_request_for(body)
    started = time.monotonic()

    def caller_gone() -> bool:
        return request.transport is None or request.transport.is_closing()

    try:
        # ProRL's coordinator waits as long
        job = await legacy.process(job_request, 2 * legacy.budget_s + 10.0, caller_gone)
    except TimeoutError:
        return _refuse(504, f"Processing timed out after {time.monotonic() - started:.0f} s")
    except CallerGone:
        log.info("job %s: its /process caller went away; cancelled", job_request.job_id)
        return _refuse(499, "the client closed its connection")  # nobody reads it
    finally:
        stopped = job_request.job_id in legacy.stopping
        legacy.stopping.discard(job_request.job_id)
    if stopped:
        return _refuse(500, "Failed to process job: Server is stopping; job cancelled")
    handler = legacy.tasks[job.request.task]
    return json_response(await prorl_result(job, handler, body.instance, legacy.chat))


_NOT_RUNNING_REPLY = Reply(503, "the API is not started (POST /start)", ProRLDetail)
OPERATIONS = (
    Operation(
        "POST",
        "/start",
        prorl_start,
        "ProRL Agent: start the legacy API (the service itself is always up)",
        (
            Reply(200, "started", ProRLReply),
            Reply(400, "already running (ProRL's clients take it so)", ProRLDetail),
        ),
        tag="prorl",
    ),
    Operation(
        "POST",
        "/stop",
        prorl_stop,
        "ProRL Agent: stop it; the /process calls in flight are cancelled and answer 500",
        (Reply(200, "stopped", ProRLReply), _NOT_RUNNING_REPLY),
        tag="prorl",
    ),
    Operation(
        "GET",
        "/status",
        prorl_status,
        "ProRL Agent: jobs in flight and by stage",
        (Reply(200, "", ProRLStatus), _NOT_RUNNING_REPLY),
        tag="prorl",
    ),
    Operation(
        "POST",
        "/add_llm_server",
        prorl_add_llm_server,
        "ProRL Agent: add an LLM server (its protocol is probed unless its URL names it)",
        (Reply(200, "added, health-checked", ProRLReply),),
        body=ProRLAddress,
        tag="prorl",
    ),
    Operation(
        "POST",
        "/clear_llm_server",
        prorl_clear_llm_server,
        "ProRL Agent: remove every LLM server",
        (Reply(200, "cleared", ProRLReply),),
        tag="prorl",
    ),
    Operation(
        "POST",
        "/cancel",
        prorl_cancel,
        "ProRL Agent: cancel the /process calls named job_id (an unknown one is no error)",
        (Reply(200, "requested", ProRLReply), _NOT_RUNNING_REPLY),
        body=ProRLCancel,
        tag="prorl",
    ),
    Operation(
        "POST",
        "/process",
        prorl_process,
        "ProRL Agent: run one episode, blocking until it is done; ProRL's result shape",
        (
            Reply(200, "the episode's result, also when it failed (`critical_error`, `filter`)", ProRLResult),
            _NOT_RUNNING_REPLY,
            Reply(500, "cancelled by /stop", ProRLDetail),
            Reply(504, "not done within twice the service's --timeout and 10 s (it is cancelled)", ProRLDetail),
        ),
        errors={
            400: "no task serves the row's data_source, the row lacks what its task needs, or a sampling "
            "parameter has a bad value: the message says which"
        },
        body=ProRLProcessRequest,
        tag="prorl",
    ),
)
