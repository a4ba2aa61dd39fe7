"""Python clients of the rollout service: `RolloutClient` (async) and `SyncRolloutClient` (for scripts).

async with RolloutClient("http://127.0.0.1:8766") as client:
    job = await client.submit(JobRequest(task="shell", instance={...}))
    trajectory = await client.result(job.job_id, wait=600)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from server_kit.errors import DownstreamError

from ..models import (
    Acknowledged,
    AckRequest,
    Batch,
    BatchRequest,
    BreakerState,
    BufferStatus,
    ImportRequest,
    JobRequest,
    JobStatus,
    LLMServerInfo,
    LLMServerList,
    LLMServerQuery,
    LLMServerRemoved,
    LLMServerRequest,
    LLMServersRequest,
    PluginList,
    PolicyVersion,
    PolicyVersionSet,
    PromptsQueued,
    PromptsRequest,
    ServiceHealth,
    ServiceStatus,
    TaskList,
    TrajectoriesImported,
    Trajectory,
    WaitQuery,
    WeightUpdateMode,
    WeightUpdatePause,
    WeightUpdateResume,
    WeightUpdateState,
)

Reply = TypeVar("Reply", bound=BaseModel)


class RolloutAPIError(DownstreamError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _raise_for(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise RolloutAPIError(response.status_code, message)
    return response


class RolloutClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, url: str, *, body: BaseModel | None = None, query: BaseModel | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One request, its body and query built from their wire models; an error reply raises RolloutAPIError."""
        if body is not None:
            kwargs["json"] = body.model_dump(mode="json", exclude_none=True)
        if query is not None:
            kwargs["params"] = query.model_dump(mode="json", exclude_none=True)
        return _raise_for(await self._http.request(method, url, **kwargs))

    async def _answer(self, reply: type[Reply], method: str, url: str, **kwargs: Any) -> Reply:
        """One request whose reply is the wire model `reply`."""
        return reply.model_validate_json((await self._call(method, url, **kwargs)).content)

    # -- jobs -----------------------------------------------------------------------------------------
    async def submit(self, request: JobRequest) -> JobStatus:
        return await self._answer(JobStatus, "POST", "/v1/jobs", body=request)

    async def job(self, job_id: str) -> JobStatus:
        return await self._answer(JobStatus, "GET", f"/v1/jobs/{job_id}")

    async def result(self, job_id: str, wait: float = 600.0) -> Trajectory:
        """The finished trajectory; long-polls in rounds of at most 60 s until `wait` has passed."""
        deadline = time.monotonic() + wait
        while True:
            round_s = max(0.0, min(60.0, deadline - time.monotonic()))
            url = f"/v1/jobs/{job_id}/result"
            response = await self._call("GET", url, query=WaitQuery(wait=round_s), timeout=round_s + self._timeout)
            if response.status_code == 200:
                return Trajectory.model_validate_json(response.content)
            job = JobStatus.model_validate_json(response.content)  # 202: not finished within the round
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} did not finish within {wait:g} s (it is {job.state.value})")

    async def run(self, request: JobRequest, wait: float = 3600.0) -> Trajectory:
        """Submit one episode and wait for its trajectory (`run_samples` for num_samples > 1)."""
        if request.num_samples != 1:
            raise ValueError("run() is for one episode; run_samples() returns the trajectories of num_samples")
        [trajectory] = await self.run_samples(request, wait)
        return trajectory

    async def run_samples(self, request: JobRequest, wait: float = 3600.0) -> list[Trajectory]:
        """Submit and wait for the trajectories of every sample (one GRPO group for num_samples > 1). A caller
        that gives up (timeout, cancellation, an error) cancels the jobs, so that their sandboxes do not run on
        for nobody."""
        job = await self.submit(request)
        ids = job.samples or [job.job_id]
        try:
            return list(await asyncio.gather(*(self.result(job_id, wait) for job_id in ids)))
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.gather(*(self.cancel(job_id) for job_id in ids)))
            raise

    async def run_many(self, requests: list[JobRequest], wait: float = 3600.0) -> list[Trajectory]:
        """Every request's trajectories, in order (a request with num_samples n gives n)."""
        groups = await asyncio.gather(*(self.run_samples(r, wait) for r in requests))
        return [trajectory for group in groups for trajectory in group]

    async def cancel(self, job_id: str) -> JobStatus:
        return await self._answer(JobStatus, "DELETE", f"/v1/jobs/{job_id}")

    # -- decoupled mode -------------------------------------------------------------------------------
    async def enqueue_prompts(self, requests: list[JobRequest]) -> int:
        """Queue upcoming episodes; the service starts them as admission control allows. Returns the prompts
        waiting to be admitted, these included."""
        queued = await self._answer(PromptsQueued, "POST", "/v1/prompts", body=PromptsRequest(requests=requests))
        return queued.upcoming

    async def take_batch(
        self,
        size: int,
        timeout: float | None = None,
        current_logprobs: dict[str, list[float]] | None = None,
        lease_s: float | None = None,
    ) -> Batch:
        """Up to `size` buffered trajectories with their staleness weights; acknowledge them after training,
        within `lease_s` (the service's default if None), or they are delivered again."""
        body = BatchRequest(size=size, timeout_s=timeout, current_logprobs=current_logprobs or {}, lease_s=lease_s)
        wait = (timeout if timeout is not None else 3600.0) + self._timeout
        return await self._answer(Batch, "POST", "/v1/batches", body=body, timeout=wait)

    async def ack(self, ids: list[str]) -> int:
        """Acknowledge taken entries; returns how many this call acknowledged (unknown or acknowledged ones: 0)."""
        return (await self._answer(Acknowledged, "POST", "/v1/batches/ack", body=AckRequest(ids=ids))).acknowledged

    async def import_trajectories(
        self, trajectories: list[dict[str, Any]], group_sizes: dict[str, int] | None = None
    ) -> TrajectoriesImported:
        """Put trajectories (ImportedTrajectory's fields) into the buffer, all of them or none."""
        body = ImportRequest.model_validate({"trajectories": trajectories, "group_sizes": group_sizes})
        return await self._answer(TrajectoriesImported, "POST", "/v1/trajectories", body=body)

    async def reset_breaker(self) -> BreakerState:
        """Close the circuit breaker (`--breaker-threshold`) and forget its counts: an operator's call."""
        return await self._answer(BreakerState, "POST", "/v1/breaker/reset")

    async def buffer(self) -> BufferStatus:
        """The buffer's counts (None while it cannot be read: `degraded` says why) and the producer's figures."""
        return await self._answer(BufferStatus, "GET", "/v1/buffer")

    # -- the service ----------------------------------------------------------------------------------
    async def health(self) -> ServiceHealth:
        """Liveness, and what does not work now (`degraded`); needs no token."""
        return await self._answer(ServiceHealth, "GET", "/healthz")

    async def status(self) -> ServiceStatus:
        return await self._answer(ServiceStatus, "GET", "/v1/status")

    async def tasks(self) -> list[str]:
        """The names of the tasks the service can run."""
        return (await self._answer(TaskList, "GET", "/v1/tasks")).tasks

    async def plugins(self) -> PluginList:
        """The service's plugins (name and hooks of each) and its plugin configuration (`config`, by section)."""
        return await self._answer(PluginList, "GET", "/v1/plugins")

    async def set_policy_version(self, version: int, raise_only: bool = False) -> int:
        """Publish the trainer's policy version; returns the version in effect (with `raise_only`, a lower
        one than asked is never set: several trainer workers may publish the same steps out of order)."""
        body = PolicyVersion(version=version, raise_only=raise_only)
        return (await self._answer(PolicyVersionSet, "PUT", "/v1/policy-version", body=body)).version

    # -- weight updates -------------------------------------------------------------------------------
    async def pause_generation(self, mode: WeightUpdateMode = "drain", timeout_s: float = 600.0) -> WeightUpdateState:
        """Take the weight-update barrier: returns once nothing generates at any replica (`drain`: the turns in
        flight finished; `abort`: they were aborted at the LLM servers and resume after `resume_generation`). It
        ends by itself `timeout_s` after this call if no resume comes."""
        body = WeightUpdatePause(mode=mode, timeout_s=timeout_s)
        # A drain waits for the longest turn in flight: the call may take as long as the barrier may hold.
        return await self._answer(
            WeightUpdateState, "POST", "/v1/weight-update/pause", body=body, timeout=timeout_s + 30
        )

    async def resume_generation(self, version: int | None = None, raise_only: bool = False) -> WeightUpdateState:
        """Release the barrier; `version`: the new weights' policy version, set before anything generates again."""
        body = WeightUpdateResume(version=version, raise_only=raise_only)
        # A `keep` resume waits for the replicas to note where their frozen requests stand, and for the servers.
        return await self._answer(WeightUpdateState, "POST", "/v1/weight-update/resume", body=body, timeout=120)

    async def weight_update_state(self) -> WeightUpdateState:
        return await self._answer(WeightUpdateState, "GET", "/v1/weight-update")

    @contextlib.asynccontextmanager
    async def weight_update(
        self, version: int | None, mode: WeightUpdateMode = "drain", timeout_s: float = 600.0, raise_only: bool = False
    ) -> AsyncIterator[WeightUpdateState]:
        """Hold the barrier around a weight push: `async with client.weight_update(v + 1): push()`. Released at
        `version` when the block ends; if it raises, released with the version unchanged (and the error raised),
        as a barrier left held would stop generation until its timeout."""
        state = await self.pause_generation(mode, timeout_s)
        try:
            yield state
        except BaseException:
            await self.resume_generation()
            raise
        await self.resume_generation(version, raise_only)

    # -- LLM servers ----------------------------------------------------------------------------------
    async def llm_servers(self) -> list[LLMServerInfo]:
        return (await self._answer(LLMServerList, "GET", "/v1/llm-servers")).servers

    async def add_llm_server(self, url: str) -> LLMServerInfo:
        """Add one server, health-checked at once (`healthy`)."""
        return await self._answer(LLMServerInfo, "POST", "/v1/llm-servers", body=LLMServerRequest(url=url))

    async def remove_llm_server(self, url: str) -> bool:
        """Remove one server; False if it was not there (not an error)."""
        query = LLMServerQuery(url=url)
        return (await self._answer(LLMServerRemoved, "DELETE", "/v1/llm-servers", query=query)).removed

    async def set_llm_servers(self, urls: list[str]) -> list[LLMServerInfo]:
        """Make `urls` the service's whole set of LLM servers, in one idempotent call."""
        body = LLMServersRequest(urls=urls)
        return (await self._answer(LLMServerList, "PUT", "/v1/llm-servers", body=body)).servers


class SyncRolloutClient:
    """The same calls, blocking; each one runs the async client on a private event loop."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = RolloutClient(base_url, token, timeout)

    @contextlib.contextmanager
    def weight_update(
        self, version: int | None, mode: WeightUpdateMode = "drain", timeout_s: float = 600.0, raise_only: bool = False
    ) -> Iterator[WeightUpdateState]:
        """`RolloutClient.weight_update`, blocking."""
        state = self.pause_generation(mode, timeout_s)
        try:
            yield state
        except BaseException:
            self.resume_generation()
            raise
        self.resume_generation(version, raise_only)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run_until_complete(method(*args, **kwargs))

        return call

    def close(self) -> None:
        self._loop.run_until_complete(self._client.aclose())
        self._loop.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
