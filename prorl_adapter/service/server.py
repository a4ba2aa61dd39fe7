"""The rollout service's HTTP API: `create_app(config)` maps /v1 onto a RolloutPipeline.

A trainer submits jobs (202 + job id), long-polls their results, cancels what it no longer needs, tells the
service the current policy version, and manages the LLM servers it generates with. `POST /process` takes
ProRL Agent's request shape and blocks until the trajectory is ready.
"""

from __future__ import annotations

import dataclasses

from aiohttp import web

from sandbox_runtime.webapp import (
    json_api,
    json_response,
    parse,
    serve_app,
)

from .. import __version__
from ..hooks.plugin_set import PluginSet
from ..models import (
    AckRequest,
    Batch,
    BatchRequest,
    JobRequest,
    LLMServerRequest,
    LLMServersRequest,
    PolicyVersion,
    ProcessRequest,
    PromptsRequest,
    SamplingParams,
)
from .chat import ChatTokenizer
from .config import RolloutConfig
from .decoupled import Producer
from .llm import LLMPool
from .metrics import RolloutMetrics
from .pipeline import Job, RolloutPipeline
from .sandboxes import SandboxPool
from .storage import create_buffer, create_prompt_queue
from .storage.buffer import ExperienceBuffer, ExperienceBufferError
from .storage.prompts import PromptQueue

PLUGINS = web.AppKey("plugins", PluginSet)
LLM = web.AppKey("llm", LLMPool)
SANDBOXES = web.AppKey("sandboxes", SandboxPool)
BUFFER = web.AppKey("buffer", ExperienceBuffer)
PROMPTS = web.AppKey("prompts", PromptQueue)
PIPELINE = web.AppKey("pipeline", RolloutPipeline)
PRODUCER = web.AppKey("producer", Producer)
METRICS = web.AppKey("metrics", RolloutMetrics)
MAX_WAIT_S = 3600.0
DECOUPLED_FIGURES = (
    "upcoming",
    "in_flight",
    "leased",
    "undelivered",
    "produced",
    "filtered",
    "retried",
    "dropped",
    "expired",
    "redelivered",
    "dead_letters",
)


class NotFound(Exception):
    status = 404


def job_of(request: web.Request) -> Job:
    job_id = request.match_info["id"]
    job = request.app[PIPELINE].jobs.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    return job


def wait_param(request: web.Request) -> float:
    try:
        wait = float(request.query.get("wait", "0"))
    except ValueError:
        raise web.HTTPBadRequest(text="`wait` must be a number of seconds") from None
    if not 0 <= wait <= MAX_WAIT_S:
        raise web.HTTPBadRequest(text=f"`wait` must be between 0 and {MAX_WAIT_S:g} seconds")
    return wait


# -- handlers -------------------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    """200 while the service serves jobs; `degraded` says what does not work now (the buffer, say) and why."""
    producer = request.app.get(PRODUCER)
    degraded = producer.stats.degraded if producer is not None else None
    return web.json_response({"ok": True, "version": __version__, "degraded": degraded})


async def metrics(request: web.Request) -> web.Response:
    app_metrics, pipeline = request.app[METRICS], request.app[PIPELINE]
    for state, count in pipeline.status()["active"].items():
        app_metrics.in_flight.labels(state).set(count)
    app_metrics.policy_version.set(pipeline.policy_version)
    figures = await request.app[PRODUCER].snapshot()
    for figure in DECOUPLED_FIGURES:
        app_metrics.decoupled.labels(figure).set(getattr(figures, figure))
    app_metrics.degraded.set(figures.degraded is not None)
    return web.Response(body=app_metrics.render(), content_type="text/plain")


async def submit_job(request: web.Request) -> web.Response:
    job, created = request.app[PIPELINE].submit(await parse(request, JobRequest))
    return json_response(job.status(), status=202 if created else 200)


async def get_job(request: web.Request) -> web.Response:
    return json_response(job_of(request).status())


async def get_result(request: web.Request) -> web.Response:
    job = job_of(request)
    job = await request.app[PIPELINE].wait(job.id, wait_param(request))
    if job.result is None:
        return json_response(job.status(), status=202)
    return json_response(job.result)


async def cancel_job(request: web.Request) -> web.Response:
    job = await request.app[PIPELINE].cancel(job_of(request).id)
    return json_response(job.status())


async def status(request: web.Request) -> web.Response:
    pipeline, producer = request.app[PIPELINE], request.app[PRODUCER]
    return web.json_response(
        {
            **pipeline.status(),
            "llm_servers": [s.model_dump() for s in pipeline.llm.servers()],
            "degraded": producer.stats.degraded,
        }
    )


async def list_tasks(request: web.Request) -> web.Response:
    return web.json_response({"tasks": sorted(request.app[PIPELINE].tasks)})


async def list_plugins(request: web.Request) -> web.Response:
    """The loaded plugins with their hooks, and the plugin configuration the service runs with (a trainer-side
    component checks that it weighs and shapes as the service does)."""
    return web.json_response({"plugins": request.app[PLUGINS].describe(), "config": request.app[PLUGINS].config})


async def list_llm_servers(request: web.Request) -> web.Response:
    return web.json_response({"servers": [s.model_dump() for s in request.app[PIPELINE].llm.servers()]})


async def add_llm_server(request: web.Request) -> web.Response:
    body: LLMServerRequest = await parse(request, LLMServerRequest)
    llm = request.app[PIPELINE].llm
    server = llm.add(body.url)
    await llm.check_health()
    return web.json_response(server.info().model_dump(), status=201)


async def remove_llm_server(request: web.Request) -> web.Response:
    url = request.query.get("url")
    if not url:
        raise web.HTTPBadRequest(text="query parameter `url` is required")
    removed = request.app[PIPELINE].llm.remove(url)  # removing one that is not there is done already
    return web.json_response({"url": url, "removed": removed})


async def set_llm_servers(request: web.Request) -> web.Response:
    """Replace the whole set at once: idempotent, so trainer workers that each set it cannot race."""
    body: LLMServersRequest = await parse(request, LLMServersRequest)
    llm = request.app[PIPELINE].llm
    llm.replace(body.urls)
    await llm.check_health()
    return web.json_response({"servers": [s.model_dump() for s in llm.servers()]})


async def set_policy_version(request: web.Request) -> web.Response:
    body: PolicyVersion = await parse(request, PolicyVersion)
    pipeline = request.app[PIPELINE]
    if not (body.raise_only and body.version <= pipeline.policy_version):
        pipeline.policy_version = body.version
    return web.json_response({"version": pipeline.policy_version})


async def process(request: web.Request) -> web.Response:
    """ProRL Agent's shape: {instance: {data_source, ...}, sampling_params, job_id?}; blocks until done."""
    body: ProcessRequest = await parse(request, ProcessRequest)
    instance = dict(body.instance)
    task = instance.pop("data_source", None)
    if not task:
        raise web.HTTPBadRequest(text="instance.data_source (the task name) is required")
    known = set(SamplingParams.model_fields)
    sampling = SamplingParams(**{k: v for k, v in body.sampling_params.items() if k in known})
    extra = {k: body.sampling_params[k] for k in ("max_turns", "max_context_tokens") if k in body.sampling_params}
    pipeline = request.app[PIPELINE]
    job, _ = pipeline.submit(JobRequest(job_id=body.job_id, task=task, instance=instance, sampling=sampling, **extra))
    await job.finished.wait()
    return json_response(job.result)


async def enqueue_prompts(request: web.Request) -> web.Response:
    body: PromptsRequest = await parse(request, PromptsRequest)
    unknown = sorted({r.task for r in body.requests} - set(request.app[PIPELINE].tasks))
    if unknown:
        raise web.HTTPBadRequest(text=f"unknown task(s) {', '.join(unknown)}")
    return web.json_response({"upcoming": await request.app[PRODUCER].enqueue(body.requests)}, status=202)


async def take_batch(request: web.Request) -> web.Response:
    body: BatchRequest = await parse(request, BatchRequest)
    timeout = MAX_WAIT_S if body.timeout_s is None else min(body.timeout_s, MAX_WAIT_S)
    items = await request.app[PRODUCER].take_batch(body.size, timeout, body.current_logprobs, body.lease_s)
    return json_response(Batch(items=items, policy_version=request.app[PIPELINE].policy_version))


async def ack_batch(request: web.Request) -> web.Response:
    body: AckRequest = await parse(request, AckRequest)
    return web.json_response({"acknowledged": await request.app[PRODUCER].ack(body.ids)})


async def buffer_status(request: web.Request) -> web.Response:
    """The buffer's counts and the producer's; during a buffer outage the counts are null and `degraded`
    says why (the producer's own figures stay)."""
    producer = request.app[PRODUCER]
    try:
        counts = dataclasses.asdict(await producer.buffer.stats())
    except ExperienceBufferError as exc:
        counts = {"ready": None, "pending": None, "acked": None, "expired": None}
        producer.stats.degraded = f"reading the buffer: {exc}"
    return web.json_response({**counts, **dataclasses.asdict(await producer.snapshot())})


def create_app(config: RolloutConfig, chat: ChatTokenizer | None = None) -> web.Application:
    """The service as an aiohttp application; each resource is opened and closed by a `cleanup_ctx` of its own,
    in the order they depend on each other (closed in reverse)."""
    app_metrics = RolloutMetrics()
    app = json_api(config.token, config.max_body_bytes, app_metrics.requests)
    app[METRICS] = app_metrics

    async def plugins(app: web.Application):
        # A bad plugin or plugin configuration fails here, at start-up.
        app[PLUGINS] = PluginSet.load(
            config.plugin_config, config.plugins, objects=[app_metrics], blocked=config.blocked_plugins
        )
        yield

    async def llm_pool(app: web.Application):
        app[LLM] = LLMPool(config.llm_urls, health_interval=config.llm_health_interval_s, plugins=app[PLUGINS])
        await app[LLM].start()
        yield
        await app[LLM].close()

    async def sandbox_pool(app: web.Application):
        app[SANDBOXES] = SandboxPool(config.sandbox_urls, token=config.sandbox_token, owner=config.sandbox_owner)
        await app[SANDBOXES].delete_leftovers()
        yield
        await app[SANDBOXES].close()

    async def buffer(app: web.Application):
        app[BUFFER] = create_buffer(config.buffer_url)
        yield
        await app[BUFFER].close()

    async def prompt_queue(app: web.Application):
        app[PROMPTS] = create_prompt_queue(config.buffer_url)
        yield
        await app[PROMPTS].close()

    async def pipeline(app: web.Application):
        tasks = app[PLUGINS].tasks()
        tokenizer = chat or ChatTokenizer(config.tokenizer)
        app[PIPELINE] = RolloutPipeline(app[PLUGINS], tasks, app[SANDBOXES], app[LLM], tokenizer, config.pipeline)
        await app[PIPELINE].start()
        yield
        await app[PIPELINE].stop()

    async def producer(app: web.Application):
        app[PRODUCER] = Producer(app[PIPELINE], app[BUFFER], app[PROMPTS], config.decoupled)
        app[PLUGINS].register(app[PRODUCER], name="decoupled-producer")  # it observes jobs and versions
        app[PRODUCER].start()
        yield
        await app[PRODUCER].stop()

    app.cleanup_ctx.extend([plugins, llm_pool, sandbox_pool, buffer, prompt_queue, pipeline, producer])
    app.router.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/metrics", metrics),
            web.post("/v1/jobs", submit_job),
            web.get("/v1/jobs/{id}", get_job),
            web.get("/v1/jobs/{id}/result", get_result),
            web.delete("/v1/jobs/{id}", cancel_job),
            web.get("/v1/status", status),
            web.get("/v1/tasks", list_tasks),
            web.get("/v1/plugins", list_plugins),
            web.get("/v1/llm-servers", list_llm_servers),
            web.post("/v1/llm-servers", add_llm_server),
            web.delete("/v1/llm-servers", remove_llm_server),
            web.put("/v1/llm-servers", set_llm_servers),
            web.put("/v1/policy-version", set_policy_version),
            web.post("/process", process),
            web.post("/v1/prompts", enqueue_prompts),
            web.post("/v1/batches", take_batch),
            web.post("/v1/batches/ack", ack_batch),
            web.get("/v1/buffer", buffer_status),
        ]
    )
    return app


async def serve(config: RolloutConfig) -> None:
    config.check_exposure()
    await serve_app(create_app(config), config.host, config.port, "prorl-rollout")
