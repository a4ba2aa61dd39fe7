"""The rollout service's HTTP API: `create_app(config)` maps /v1 onto a RolloutPipeline.

`ROLLOUT_API` describes every operation once: it routes the requests and writes the OpenAPI document served at
/openapi.json (server_kit.openapi).

A trainer submits jobs (202 + job id), long-polls their results, cancels what it no longer needs, tells the
service the current policy version, and manages the LLM servers it generates with. ProRL Agent's legacy calls
(`/start`, `/process`, ...) are served beside them by prorl_api.py, on the same pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import re
from collections.abc import Callable

from aiohttp import web

from sandbox_runtime.config import RUNTIME_NAME
from sandbox_runtime.models import RuntimeHeartbeat
from server_kit.connections import mark_credential_checked
from server_kit.errors import ApiError
from server_kit.openapi import API, Link, Operation, Reply, metrics_operation, operations_under
from server_kit.webapp import (
    Handler,
    Middleware,
    Site,
    bound_socket,
    error_response,
    json_api,
    json_response,
    serve_sites,
)

from .. import __version__
from ..hooks.plugin_set import PluginSet
from ..models import (
    Acknowledged,
    AckRequest,
    Batch,
    BatchRequest,
    BreakerState,
    BufferStatus,
    ImportRequest,
    JobList,
    JobRequest,
    JobsQuery,
    JobStatus,
    LLMOutage,
    LLMServerInfo,
    LLMServerList,
    LLMServerQuery,
    LLMServerRemoved,
    LLMServerRequest,
    LLMServersRequest,
    PluginInfo,
    PluginList,
    PolicyVersion,
    PolicyVersionSet,
    PromptsQueued,
    PromptsRequest,
    RuntimeRegistered,
    RuntimeStateList,
    ServiceHealth,
    ServiceStatus,
    TaskList,
    TrajectoriesImported,
    Trajectory,
    TrajectoryTokens,
    WaitQuery,
    WeightUpdatePause,
    WeightUpdateResume,
    WeightUpdateState,
)
from . import gateway, prorl_api, viewer
from .chat import ChatTokenizer
from .circuit_breaker import CircuitBreaker
from .config import RolloutConfig
from .decoupled import Producer
from .imports import imported_trajectories
from .llm import LLMPool
from .metrics import RolloutMetrics
from .pipeline import RolloutPipeline
from .records import Records
from .replica import Replica
from .sandboxes import SandboxPool
from .storage import create_buffer, create_coordination, create_prompt_queue
from .storage.buffer import ExperienceBuffer, ExperienceBufferError
from .storage.coordination import Coordination
from .storage.job_board import JobBoard, MemoryJobBoard
from .storage.prompts import PromptQueue
from .weight_barrier import WeightBarrier

PLUGINS = web.AppKey("plugins", PluginSet)
LLM = web.AppKey("llm", LLMPool)
SANDBOXES = web.AppKey("sandboxes", SandboxPool)
BUFFER = web.AppKey("buffer", ExperienceBuffer)
PROMPTS = web.AppKey("prompts", PromptQueue)
PIPELINE = web.AppKey("pipeline", RolloutPipeline)
RECORDS = web.AppKey("records", object)  # Records, or None without --record
PRODUCER = web.AppKey("producer", Producer)
COORDINATION = web.AppKey("coordination", Coordination)
BOARD = web.AppKey("board", JobBoard)
REPLICA = web.AppKey("replica", Replica)
METRICS = web.AppKey("metrics", RolloutMetrics)
BREAKER = web.AppKey("breaker", CircuitBreaker)
GATEWAY_APP = web.AppKey("gateway_app", web.Application)
REGISTRATION_CREDENTIAL = web.AppKey("registration_credential", str)
TASKS = web.AppKey("tasks", dict)  # task name -> TaskHandler, from the plugins
STARTING_BEATS = web.AppKey("starting_beats", asyncio.Task)  # the heartbeat until the replica's own loop beats
BARRIER = web.AppKey("barrier", WeightBarrier)  # the pipeline's: every generation request passes it
GATEWAY_ADDRESS: web.AppKey[str | None] = web.AppKey("gateway_address")  # where runtimes reach the LLM gateway
MAX_WAIT_S = 3600.0
DECOUPLED_FIGURES = (
    "upcoming",
    "in_flight",
    "leased",
    "undelivered",
    "produced",
    "filtered",
    "retried",
    "outage_reruns",
    "dropped",
    "expired",
    "redelivered",
    "dead_letters",
    "admission_lock_lapses",
)


class BadRequest(ApiError, ValueError):
    status = 400


class Conflict(ApiError, ValueError):
    status = 409


# -- handlers -------------------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    """200 while the service serves jobs; `degraded` says what does not work now (the buffer, the LLM servers,
    the replica's fence) and why."""
    producer = request.app.get(PRODUCER)
    degraded = producer.stats.degraded if producer is not None else None
    llm = request.app.get(LLM)
    degraded = with_outage(degraded, llm.outage() if llm is not None else None)
    replica = request.app.get(REPLICA)
    if replica is not None and replica.fenced:
        said = "fenced: this replica's beats do not reach Redis; it runs nothing until one does"
        degraded = said if degraded is None else f"{degraded}; {said}"
    return json_response(ServiceHealth(ok=True, version=__version__, degraded=degraded))


def with_outage(degraded: str | None, outage: LLMOutage | None) -> str | None:
    """`degraded` with the LLM outage's reason added, where there is one."""
    if outage is None:
        return degraded
    said = f"LLM outage: {outage.reason} ({outage.waiting} turns waiting for a server)"
    return said if degraded is None else f"{degraded}; {said}"


async def metrics(request: web.Request) -> web.Response:
    app_metrics, runner = request.app[METRICS], request.app[PIPELINE]
    status = runner.status()
    for state, count in status["active"].items():
        app_metrics.in_flight.labels(state).set(count)
    app_metrics.policy_version.set(status["policy_version"])
    barrier = request.app[BARRIER]
    state = barrier.state()
    for figure, value in (
        ("paused", state.paused),
        ("in_flight", state.in_flight),
        ("waiting", state.waiting),
        ("pauses", state.pauses),
        ("expired", state.expired),
        ("held_seconds", barrier.held_s()),
    ):
        app_metrics.weight_update.labels(figure).set(value)
    app_metrics.set_run_concurrency(status["run_concurrency"])
    figures = await request.app[PRODUCER].snapshot()
    for figure in DECOUPLED_FIGURES:
        app_metrics.decoupled.labels(figure).set(getattr(figures, figure))
    app_metrics.degraded.set(figures.degraded is not None)
    llm = request.app[LLM]
    app_metrics.set_llm_outage(llm.outage(), llm.outage_waits)
    warm = request.app[SANDBOXES].warm
    if warm is not None:
        app_metrics.count_warm(warm.hits, warm.misses)
    breaker = request.app[BREAKER]
    app_metrics.set_breaker(breaker.describe(), breaker.totals)
    return web.Response(body=app_metrics.render(), content_type="text/plain")


def refuse_service_fields(request: JobRequest) -> None:
    """`attempt`, `retry_of` and `outage_reruns` are the service's: set by a client, they would change how often its
    prompt runs."""
    if request.attempt != 1 or request.retry_of is not None or request.outage_reruns:
        raise BadRequest(
            "attempt and retry_of are set by the service (a prompt run again), and outage_reruns too: leave them out"
        )


async def submit_job(request: web.Request, body: JobRequest) -> web.Response:
    refuse_service_fields(body)
    request.app[BREAKER].check_admission()
    statuses, created = await request.app[BOARD].submit(body)
    status = statuses[0]
    if body.num_samples > 1:
        status.samples = [sample.job_id for sample in statuses]
    return json_response(status, status=202 if created else 200)  # 200: every one was there already (a retry)


async def get_job(request: web.Request) -> web.Response:
    return json_response(await request.app[BOARD].status(request.match_info["id"]))


async def get_result(request: web.Request, query: WaitQuery) -> web.Response:
    reply = await request.app[BOARD].result(request.match_info["id"], query.wait)
    return json_response(reply, status=202 if isinstance(reply, JobStatus) else 200)


async def list_jobs(request: web.Request, query: JobsQuery) -> web.Response:
    """The jobs this replica keeps (its pipeline's: with a shared job board, those it ran), newest first: the
    viewer's list."""
    pipeline = request.app[PIPELINE]
    version = pipeline.policy_version
    jobs = reversed(pipeline.jobs.values())
    chosen, matched = viewer.matching(jobs, lambda job: job.state, lambda job: job.request.task, query)
    summaries = [
        viewer.summary(
            job.id, job.request.task, job.state, job.timings, job.result, job.error, version, job.submitted_at
        )
        for job in chosen
    ]
    return json_response(JobList(jobs=summaries, matched=matched, policy_version=version, source="live"))


async def job_tokens(request: web.Request) -> web.Response:
    """A finished job's trajectory as token pieces, by the service's tokenizer (on its thread)."""
    reply = await request.app[BOARD].result(request.match_info["id"], 0.0)
    if isinstance(reply, JobStatus):
        return json_response(reply, status=202)
    chat = request.app[PIPELINE].chat
    return json_response(await chat.off_loop(viewer.trajectory_tokens, reply, chat))


async def cancel_job(request: web.Request) -> web.Response:
    return json_response(await request.app[BOARD].cancel(request.match_info["id"]))


async def service_status(request: web.Request) -> web.Response:
    """This replica's queues and jobs, every replica sharing its state, and the runtimes it may use."""
    runner, producer, replica = request.app[PIPELINE], request.app[PRODUCER], request.app[REPLICA]
    sandboxes = request.app[SANDBOXES]
    await sandboxes.refresh()
    degraded = producer.stats.degraded
    try:
        replicas = await replica.describe()
    except ExperienceBufferError as exc:  # the shared state is away: this replica's own view still answers
        replicas = []
        degraded = degraded or f"reading the replicas: {exc}"
    outage = request.app[LLM].outage()
    return json_response(
        ServiceStatus(
            **runner.status(),
            llm_servers=request.app[LLM].servers(),
            llm_outage=outage,
            degraded=with_outage(degraded, outage),
            gateway_address=request.app[GATEWAY_ADDRESS],
            replica=replica.id,
            replicas=replicas,
            runtimes=sandboxes.describe(),
            warm_sandboxes=sandboxes.describe_warm(),
            breaker=request.app[BREAKER].describe(),
        )
    )


async def reset_breaker(request: web.Request) -> web.Response:
    """An operator's decision that training may go on: the breaker closes, its counts start again from zero, and
    queued prompts are admitted again."""
    state = request.app[BREAKER].reset()
    request.app[PRODUCER].wake()
    return json_response(state)


async def runtime_heartbeat(request: web.Request, body: RuntimeHeartbeat) -> web.Response:
    """A sandbox runtime registering itself (`prorl-sandbox serve --register`): recorded for every replica. A name
    stays bound to the URL it was registered with while that runtime is alive (until it leaves, or misses three
    heartbeats): another URL under a live name is refused (409), so no registered node takes another's name, and
    with it the traffic and the token the service calls it with. The token a runtime sends is its own; the
    registration token is refused as one (every registered runtime holds it)."""
    name = request.match_info["name"]
    if not RUNTIME_NAME.fullmatch(name):
        raise BadRequest(f"runtime name {name[:200]!r}: 1-128 of letters, digits and . _ : -")
    credential = request.app[REGISTRATION_CREDENTIAL]
    if body.token is not None and credential is not None and hmac.compare_digest(body.token, credential):
        raise BadRequest("the runtime's own token must not be the registration token: give it a --token of its own")
    coordination = request.app[COORDINATION]
    now, records = await coordination.runtimes()
    bound = next((r for r in records if r.name == name and r.alive(now)), None)
    if bound is not None and bound.heartbeat.url.rstrip("/") != body.url.rstrip("/"):
        raise Conflict(
            f"runtime name {name!r} is registered with another URL; it stays so until that runtime leaves or "
            "misses three heartbeats"
        )
    await coordination.runtime_heard(name, body)
    return json_response(RuntimeRegistered(name=name, alive=not body.leaving))


async def list_runtimes(request: web.Request) -> web.Response:
    sandboxes = request.app[SANDBOXES]
    await sandboxes.refresh()
    return json_response(RuntimeStateList(runtimes=sandboxes.describe()))


async def list_tasks(request: web.Request) -> web.Response:
    return json_response(TaskList(tasks=sorted(request.app[TASKS])))


async def list_plugins(request: web.Request) -> web.Response:
    """The loaded plugins with their hooks, and the plugin configuration the service runs with (a trainer-side
    component checks that it weighs and shapes as the service does)."""
    plugins = request.app[PLUGINS]
    return json_response(PluginList(plugins=[PluginInfo(**p) for p in plugins.describe()], config=plugins.config))


async def list_llm_servers(request: web.Request) -> web.Response:
    return json_response(LLMServerList(servers=request.app[LLM].servers()))


async def add_llm_server(request: web.Request, body: LLMServerRequest) -> web.Response:
    info = await request.app[LLM].check(body.url)
    request.app[PRODUCER].wake()  # a replica held for want of an LLM server admits again
    return json_response(info, status=201)


async def remove_llm_server(request: web.Request, query: LLMServerQuery) -> web.Response:
    removed = request.app[LLM].remove(query.url)  # removing one that is not there is done already
    return json_response(LLMServerRemoved(url=query.url, removed=removed))


async def set_llm_servers(request: web.Request, body: LLMServersRequest) -> web.Response:
    """Replace the whole set at once: idempotent, so trainer workers that each set it cannot race."""
    llm = request.app[LLM]
    llm.replace(body.urls)
    await llm.check_health()
    request.app[PRODUCER].wake()
    return json_response(LLMServerList(servers=llm.servers()))


async def set_policy_version(request: web.Request, body: PolicyVersion) -> web.Response:
    """The version is the replicas' shared one: set through any of them, every one tags new turns with it."""
    version = await request.app[COORDINATION].set_policy_version(body.version, body.raise_only)
    return json_response(PolicyVersionSet(version=version))


async def pause_generation(request: web.Request, body: WeightUpdatePause) -> web.Response:
    """Take the weight-update barrier; answered once nothing generates at any replica (docs/rollout.md)."""
    return json_response(await request.app[BARRIER].pause(body.mode, body.timeout_s))


async def resume_generation(request: web.Request, body: WeightUpdateResume) -> web.Response:
    return json_response(await request.app[BARRIER].resume(body.version, body.raise_only))


async def weight_update_state(request: web.Request) -> web.Response:
    return json_response(request.app[BARRIER].state())


async def enqueue_prompts(request: web.Request, body: PromptsRequest) -> web.Response:
    for prompt in body.requests:  # a prompt that can never run is refused now, not dropped later
        refuse_service_fields(prompt)
        request.app[PIPELINE].check(prompt)
    samples = [sample for r in body.requests for sample in r.samples()]
    return json_response(PromptsQueued(upcoming=await request.app[PRODUCER].enqueue(samples)), status=202)


async def take_batch(request: web.Request, body: BatchRequest) -> web.Response:
    timeout = MAX_WAIT_S if body.timeout_s is None else min(body.timeout_s, MAX_WAIT_S)
    items = await request.app[PRODUCER].take_batch(body.size, timeout, body.current_logprobs, body.lease_s)
    version = request.app[PIPELINE].policy_version
    request.app[METRICS].took(items, version)
    return json_response(Batch(items=items, policy_version=version))


async def import_trajectories(request: web.Request, body: ImportRequest) -> web.Response:
    pipeline = request.app[PIPELINE]
    checked = (body, pipeline.chat.vocab_size, pipeline.policy_version)
    trajectories = await asyncio.to_thread(imported_trajectories, *checked)  # checks every id: off the loop
    ids = await request.app[PRODUCER].import_trajectories(trajectories)
    return json_response(
        TrajectoriesImported(imported=len(ids), ids=ids, job_ids=[t.job_id for t in trajectories]), status=201
    )


async def ack_batch(request: web.Request, body: AckRequest) -> web.Response:
    return json_response(Acknowledged(acknowledged=await request.app[PRODUCER].ack(body.ids)))


async def buffer_status(request: web.Request) -> web.Response:
    """The buffer's counts and the producer's; during a buffer outage the counts are null and `degraded`
    says why (the producer's own figures stay)."""
    producer = request.app[PRODUCER]
    try:
        stats = await producer.buffer.stats()
        counts = {"ready": stats.ready, "pending": stats.pending, "acked": stats.acked, "buffer_expired": stats.expired}
    except ExperienceBufferError as exc:
        counts = {"ready": None, "pending": None, "acked": None, "buffer_expired": None}
        producer.stats.degraded = f"reading the buffer: {exc}"
    figures = await producer.snapshot()
    return json_response(BufferStatus(**counts, **figures.model_dump()))


REGISTRATION_PATH = "/v1/runtimes/{name}"


def registration_gate(credential: str | None) -> Middleware:
    """Registering a runtime needs the registration credential, with or without a service token: whatever
    registers is sent episodes' files and a token, and is believed about their rewards. The service's API token
    is not it (a runtime needs no power over jobs or LLM servers), so the bearer check skips this path and this
    gate checks it, before the body is read, in constant time."""
    expected = f"Bearer {credential}".encode() if credential else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is None or resource.canonical != REGISTRATION_PATH:
            return await handler(request)
        if expected is None:
            return error_response(
                403,
                "this service takes no runtime registrations: start it with --registration-token "
                "(env PRORL_REGISTRATION_TOKEN) or --sandbox-token, and the runtimes with the same --register-token",
            )
        sent = request.headers.get("Authorization", "").encode("utf-8", errors="surrogateescape")
        if not hmac.compare_digest(sent, expected):
            return error_response(
                401,
                "registering a runtime needs the registration token (Authorization: Bearer <token>; the runtime's "
                "--register-token, env PRORL_REGISTRATION_TOKEN)",
            )
        mark_credential_checked(request)
        return await handler(request)

    return middleware


# -- the API, described once: routes and the OpenAPI document ---------------------------------------------
JOB_ID = {"id": {"type": "string", "description": "the job_id POST /v1/jobs answered with"}}
NO_JOB = {404: "no such job (or it finished long enough ago to be forgotten)"}
JOB_LINKS = {name: Link(name, {"id": "$response.body#/job_id"}) for name in ("get_job", "get_result", "cancel_job")}
BUFFER_DOWN = {503: "the buffer's storage (Redis) cannot be reached now; try again"}


job_op = operations_under("/v1/jobs/{id}", JOB_ID, NO_JOB, "jobs")


ROLLOUT_API = API(
    name="rollout",
    program="prorl-rollout",
    title="prorl-rollout: the rollout service",
    version=__version__,
    description="Episodes of agent tasks (init, run, eval) as jobs, token ids and logprobs in the trajectories, "
    "and the decoupled mode's prompts, batches and acknowledgements. Every error is an ErrorBody; see "
    "docs/rollout.md for the model behind the calls.",
    default_port=8766,
    operations=(
        Operation(
            "GET",
            "/healthz",
            healthz,
            "Liveness and what is degraded",
            (Reply(200, "", ServiceHealth),),
            public=True,
            tag="service",
        ),
        metrics_operation(metrics, tag="service"),
        Operation(
            "GET",
            "/v1/status",
            service_status,
            "Queues, jobs, workers, LLM servers",
            (Reply(200, "", ServiceStatus),),
            tag="service",
        ),
        Operation(
            "PUT",
            REGISTRATION_PATH,
            runtime_heartbeat,
            "A sandbox runtime's heartbeat: where it is, its room; `leaving` stops its use",
            (Reply(200, "recorded (for every replica sharing this one's state)", RuntimeRegistered),),
            body=RuntimeHeartbeat,
            path_parameters={"name": {"type": "string", "pattern": f"^{RUNTIME_NAME.pattern}$"}},
            tag="runtimes",
            errors={
                400: "the body is not valid, or its `token` is the registration token",
                401: "no registration token, or a wrong one (Authorization: Bearer <registration token>)",
                403: "this service takes no registrations (started without a registration or sandbox token)",
                409: "the name is registered with another URL by a runtime still alive",
            },
            description="Sent by `prorl-sandbox serve --register URL` every few seconds; a runtime not heard from "
            "for three of its intervals gets no new sandboxes. Needs the registration token (not the API token), "
            "whether or not the service has one; the service then calls the runtime with the `token` of its "
            "heartbeat (the runtime's own), never with the registration token. A name stays bound to its URL "
            "until its runtime leaves or lapses. See docs/scale-out.md.",
        ),
        Operation(
            "GET",
            "/v1/runtimes",
            list_runtimes,
            "The sandbox runtimes this replica may use, given or registered",
            (Reply(200, "", RuntimeStateList),),
            tag="runtimes",
        ),
        Operation(
            "GET",
            "/v1/tasks",
            list_tasks,
            "The task names the service can run",
            (Reply(200, "", TaskList),),
            tag="service",
        ),
        Operation(
            "GET",
            "/v1/plugins",
            list_plugins,
            "The loaded plugins and their configuration",
            (Reply(200, "", PluginList),),
            tag="service",
        ),
        Operation(
            "POST",
            "/v1/jobs",
            submit_job,
            "Submit one episode",
            (
                Reply(202, "queued", JobStatus, links=JOB_LINKS),
                Reply(200, "a job with this job_id and the same request exists: that job", JobStatus, links=JOB_LINKS),
            ),
            errors={
                400: "the request is not valid, or names an unknown task",
                409: "the job_id is taken by a different request",
                503: "the circuit breaker has tripped (the message says why): no job is admitted until "
                "POST /v1/breaker/reset",
            },
            body=JobRequest,
            tag="jobs",
        ),
        job_op("GET", "", get_job, "A job's state and timings", (Reply(200, "", JobStatus),)),
        job_op(
            "GET",
            "/result",
            get_result,
            "The trajectory, long-polling up to `wait` seconds",
            (
                Reply(200, "finished: the trajectory (a failed job's carries `error` and `filter`)", Trajectory),
                Reply(202, "not finished within `wait`: the job's state", JobStatus),
            ),
            query=WaitQuery,
        ),
        Operation(
            "GET",
            "/v1/jobs",
            list_jobs,
            "The jobs this replica keeps, newest first, with their rewards and timings (the viewer's list)",
            (Reply(200, "", JobList),),
            query=JobsQuery,
            tag="viewer",
        ),
        job_op(
            "GET",
            "/tokens",
            job_tokens,
            "A finished job's trajectory as token pieces and per-token policy versions (the viewer's token view)",
            (
                Reply(200, "finished: its token sequences", TrajectoryTokens),
                Reply(202, "not finished: the job's state", JobStatus),
            ),
        ),
        *viewer.page_operations("viewer"),
        job_op(
            "DELETE",
            "",
            cancel_job,
            "Cancel a job (its sandbox is deleted)",
            (Reply(200, "the job, now final", JobStatus),),
        ),
        Operation(
            "PUT",
            "/v1/policy-version",
            set_policy_version,
            "Set the policy version new turns are tagged with",
            (Reply(200, "", PolicyVersionSet),),
            body=PolicyVersion,
            tag="training",
        ),
        Operation(
            "POST",
            "/v1/weight-update/pause",
            pause_generation,
            "Before pushing weights: stop generation at every replica (new turns wait; in-flight ones drain or are "
            "aborted to be resumed) and answer once nothing generates",
            (Reply(200, "the barrier, held", WeightUpdateState),),
            errors={
                400: "the request is not valid, or an LLM server cannot pause in this mode (ProRL's: drain only)",
                409: "the barrier expired before generation drained",
                502: "an LLM server failed to pause (the barrier is released)",
            },
            body=WeightUpdatePause,
            tag="training",
        ),
        Operation(
            "POST",
            "/v1/weight-update/resume",
            resume_generation,
            "After pushing weights: set the new policy version and let generation go on (idempotent)",
            (Reply(200, "the barrier, released", WeightUpdateState),),
            body=WeightUpdateResume,
            tag="training",
        ),
        Operation(
            "POST",
            "/v1/breaker/reset",
            reset_breaker,
            "Close the circuit breaker and forget its counts: admission resumes (an operator's call)",
            (Reply(200, "the breaker, closed", BreakerState),),
            tag="training",
            description="The breaker (--breaker-threshold) pauses admission when too many of one policy version's "
            "episodes were graded as tampered, hit sandbox limits or were refused at the gateway; a new policy "
            "version does not close it. See docs/rollout.md.",
        ),
        Operation(
            "GET",
            "/v1/weight-update",
            weight_update_state,
            "The weight-update barrier as this replica sees it",
            (Reply(200, "", WeightUpdateState),),
            tag="training",
        ),
        Operation(
            "GET",
            "/v1/llm-servers",
            list_llm_servers,
            "The LLM servers",
            (Reply(200, "", LLMServerList),),
            tag="llm-servers",
        ),
        Operation(
            "POST",
            "/v1/llm-servers",
            add_llm_server,
            "Add an LLM server (adding one that is there changes nothing)",
            (Reply(201, "the server, health-checked", LLMServerInfo),),
            body=LLMServerRequest,
            tag="llm-servers",
        ),
        Operation(
            "PUT",
            "/v1/llm-servers",
            set_llm_servers,
            "Replace the whole set of LLM servers at once (idempotent)",
            (Reply(200, "the new set, health-checked", LLMServerList),),
            body=LLMServersRequest,
            tag="llm-servers",
        ),
        Operation(
            "DELETE",
            "/v1/llm-servers",
            remove_llm_server,
            "Remove an LLM server (idempotent); its episodes fail over",
            (Reply(200, "", LLMServerRemoved),),
            query=LLMServerQuery,
            tag="llm-servers",
        ),
        Operation(
            "POST",
            "/v1/prompts",
            enqueue_prompts,
            "Decoupled mode: queue upcoming episodes, started as admission control allows",
            (Reply(202, "queued", PromptsQueued),),
            errors={400: "a request is not valid, or names an unknown task", **BUFFER_DOWN},
            body=PromptsRequest,
            tag="decoupled",
        ),
        Operation(
            "POST",
            "/v1/batches",
            take_batch,
            "Decoupled mode: take up to `size` weighed trajectories, waiting up to `timeout_s`",
            (Reply(200, "the batch (possibly fewer items, or none, when the wait ran out)", Batch),),
            errors={
                400: "the request is not valid, or `current_logprobs` of an entry has the wrong length",
                **BUFFER_DOWN,
            },
            body=BatchRequest,
            tag="decoupled",
        ),
        Operation(
            "POST",
            "/v1/batches/ack",
            ack_batch,
            "Decoupled mode: acknowledge taken entries (after training on them)",
            (Reply(200, "", Acknowledged),),
            errors={400: "an id is not one this buffer hands out", **BUFFER_DOWN},
            body=AckRequest,
            tag="decoupled",
        ),
        Operation(
            "POST",
            "/v1/trajectories",
            import_trajectories,
            "Decoupled mode: put recorded or externally made trajectories into the experience buffer (all or none)",
            (Reply(201, "every one is in the buffer", TrajectoriesImported),),
            errors={
                400: "the request is not valid: the message names the field (a length that differs from "
                "response_ids', an id outside the tokenizer's vocabulary, a group not in group_sizes); nothing "
                "was put",
                409: "the buffer would hold more than max_buffered entries with them: nothing was put",
                **BUFFER_DOWN,
            },
            body=ImportRequest,
            tag="decoupled",
            description="Replay of a past run's records (`prorl-rollout import`) or off-policy data made elsewhere: "
            "each is delivered by `POST /v1/batches` like the service's own, weighed by the staleness plugin by "
            "the versions of its tokens.",
        ),
        Operation(
            "GET",
            "/v1/buffer",
            buffer_status,
            "Decoupled mode: the buffer's and the producer's figures",
            (Reply(200, "", BufferStatus),),
            tag="decoupled",
        ),
        *prorl_api.OPERATIONS,
    ),
)


def create_app(config: RolloutConfig, chat: ChatTokenizer | None = None) -> web.Application:
    """The service as an aiohttp application; each resource is opened and closed by a `cleanup_ctx` of its own,
    in the order they depend on each other (closed in reverse)."""
    app_metrics = RolloutMetrics()
    gates = [registration_gate(config.registration_credential)]
    app = json_api(
        ROLLOUT_API, config.token, config.max_body_bytes, app_metrics.requests, gates, frozenset({REGISTRATION_PATH})
    )
    app[METRICS] = app_metrics
    app[BREAKER] = breaker = CircuitBreaker(config.breaker)
    app[GATEWAY_ADDRESS] = config.pipeline.gateway_address  # `serve` has set it by now: the socket is bound first
    app[REGISTRATION_CREDENTIAL] = config.registration_credential  # type: ignore[assignment]
    app[GATEWAY_APP] = gateway.create_gateway_app(app_metrics.requests)

    async def plugins(app: web.Application):
        # A bad plugin or plugin configuration fails here, at start-up; so does a record directory it cannot make.
        records = None
        if config.record_dir is not None:
            records = Records(config.record_dir, re.sub(r"[^A-Za-z0-9._-]", "_", config.sandbox_owner))
        app[RECORDS] = records
        objects = [app_metrics, breaker] + ([records] if records else [])
        app[PLUGINS] = PluginSet.load(
            config.plugin_config, config.plugins, objects=objects, blocked=config.blocked_plugins
        )
        yield
        if records is not None:  # closed last: every job's trajectory and call has been queued by now
            await asyncio.to_thread(records.close)

    async def llm_pool(app: web.Application):
        app[LLM] = LLMPool(
            config.llm_urls,
            health_interval=config.llm_health_interval_s,
            outage_wait_s=config.llm_outage_wait_s,
            call_timeout_s=config.llm_call_timeout_s,
            plugins=app[PLUGINS],
            stream=config.llm_stream,
        )
        await app[LLM].start()
        yield
        await app[LLM].close()

    async def coordination(app: web.Application):
        app[COORDINATION] = create_coordination(config.buffer_url, config.sandbox_owner)
        await app[COORDINATION].start()
        # A beat before anything is taken back or claimed, and beats on until the replica's own loop takes over: a
        # survivor must not take this replica for dead (its earlier incarnation's record lapsed, or the rest of the
        # start-up, the LLM servers' first health check, say, outlasted three beats) while it starts.
        with contextlib.suppress(ExperienceBufferError):
            await app[COORDINATION].beat(config.replica_url, {}, config.heartbeat_s)
        app[STARTING_BEATS] = asyncio.create_task(beat_while_starting(app[COORDINATION], config))
        yield
        app[STARTING_BEATS].cancel()
        await app[COORDINATION].close()

    async def sandbox_pool(app: web.Application):
        app[SANDBOXES] = SandboxPool(
            config.sandbox_urls,
            token=config.sandbox_token,
            owner=config.sandbox_owner,
            coordination=app[COORDINATION],
            warm=config.warm,
            max_concurrent_creates=config.max_concurrent_creates,
            wait_for_runtime_s=config.wait_for_runtime_s,
        )
        await app[SANDBOXES].delete_leftovers()
        app[SANDBOXES].start_watching()
        yield
        await app[SANDBOXES].close()

    async def buffer(app: web.Application):
        app[BUFFER] = create_buffer(config.buffer_url, consumer=config.sandbox_owner)
        yield
        await app[BUFFER].close()

    async def prompt_queue(app: web.Application):
        app[PROMPTS] = create_prompt_queue(config.buffer_url, config.sandbox_owner)
        yield
        await app[PROMPTS].close()

    async def pipeline(app: web.Application):
        app[TASKS] = tasks = app[PLUGINS].tasks()
        # Loaded on a thread: seconds of work that would hold the event loop (and the start-up beats) still.
        tokenizer = chat or await asyncio.to_thread(ChatTokenizer, config.tokenizer)
        app[PIPELINE] = RolloutPipeline(
            app[PLUGINS], tasks, app[SANDBOXES], app[LLM], tokenizer, config.pipeline, app[COORDINATION]
        )
        budget_s = config.pipeline.default_timeout_s
        app[prorl_api.LEGACY] = prorl_api.ProRLLegacy(app[PIPELINE], tasks, app[LLM], tokenizer, budget_s)
        app[GATEWAY_APP][gateway.GATEWAY] = app[PIPELINE].gateway  # set before the gateway's app starts
        app[PIPELINE].gateway.records = app[RECORDS]
        app[BARRIER] = app[PIPELINE].barrier
        await app[PIPELINE].start()
        yield
        await app[PIPELINE].stop()

    async def job_board(app: web.Application):
        if app[COORDINATION].shared:
            from .storage.redis_job_board import RedisJobBoard  # the redis package is an optional extra

            app[BOARD] = RedisJobBoard(app[PIPELINE], app[COORDINATION], result_ttl_s=config.result_ttl_s)
        else:
            app[BOARD] = MemoryJobBoard(app[PIPELINE])
        await app[BOARD].start()
        yield
        await app[BOARD].stop()

    async def producer(app: web.Application):
        app[PRODUCER] = Producer(
            app[PIPELINE], app[BUFFER], app[PROMPTS], config.decoupled, app[COORDINATION], llm=app[LLM]
        )
        app[PLUGINS].register(app[PRODUCER], name="decoupled-producer")  # it observes jobs and versions
        app[PRODUCER].start()
        yield
        await app[PRODUCER].stop()

    async def replica(app: web.Application):
        app[REPLICA] = Replica(
            app[COORDINATION],
            app[PIPELINE],
            app[BOARD],
            app[PRODUCER],
            app[SANDBOXES],
            config.replica_url,
            config.heartbeat_s,
        )
        app[STARTING_BEATS].cancel()  # the replica beats from now on
        await app[REPLICA].start()
        yield
        await app[REPLICA].stop()

    app.cleanup_ctx.extend(
        [plugins, coordination, llm_pool, sandbox_pool, buffer, prompt_queue, pipeline, job_board, producer, replica]
    )
    return app


async def beat_while_starting(coordination: Coordination, config: RolloutConfig) -> None:
    """The replica's heartbeat while the service starts, before its `Replica` beats (Redis away: tried again)."""
    while True:
        await asyncio.sleep(config.heartbeat_s)  # a period, not a synchronisation
        with contextlib.suppress(ExperienceBufferError):
            await coordination.beat(config.replica_url, {}, config.heartbeat_s)


async def serve(config: RolloutConfig, ready: Callable[[], None] | None = None) -> None:
    """Run the service until SIGTERM/SIGINT; `ready` is called once both listeners are up."""
    config.check()
    # The gateway's socket is bound first: its address must be known before the pipeline admits an episode.
    gateway_socket = bound_socket(config.gateway_host, config.gateway_port)
    if config.pipeline.gateway_address is None:  # where runtimes on this machine reach it
        config.pipeline.gateway_address = gateway_address(config.gateway_host, gateway_socket.getsockname()[1])
    app = create_app(config)
    app.on_startup.append(freeze_long_lived)  # after the cleanup contexts' start-up: the tokenizer is loaded
    sites = [
        Site(app, config.host, config.port, "prorl-rollout", sock=config.listen_socket),
        Site(app[GATEWAY_APP], config.gateway_host, 0, "prorl-rollout's LLM gateway", sock=gateway_socket),
    ]
    await serve_sites(sites, config.connections, ready=ready)


async def freeze_long_lived(app: web.Application) -> None:
    """Leave what start-up made out of the garbage collector's full collections, for good (`gc.freeze`).

    The imports (transformers, and torch with it) and the tokenizer are some 400,000 objects that live as long as
    the process. A full collection scans them all: measured in this service under bench_rollout's load, one took
    0.26 s of CPU, a quarter of the service's CPU for 64 episodes, and held the event loop, with every episode
    in flight, for as long. Frozen, collections scan only what the service made since. Called once, by `serve`,
    not by `create_app`: tests make many apps in one process, and freezing their garbage would keep it."""
    gc.freeze()


def gateway_address(host: str, port: int) -> str:
    """Where a runtime on this machine reaches the gateway: its host, or loopback for a wildcard address."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
