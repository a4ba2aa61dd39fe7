"""Python clients of the rollout service: `RolloutClient` (async) and `SyncRolloutClient` (for scripts).

async with RolloutClient("http://127.0.0.1:8766") as client:
    job = await client.submit(JobRequest(task="shell", instance={...}))
    trajectory = await client.result(job.job_id, wait=600)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx

from ..models import (
    AckRequest,
    Batch,
    BatchRequest,
    JobRequest,
    JobStatus,
    LLMServersRequest,
    PolicyVersion,
    PromptsRequest,
    Trajectory,
)


class RolloutAPIError(Exception):
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

    async def _call(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return _raise_for(await self._http.request(method, url, **kwargs))

    async def submit(self, request: JobRequest) -> JobStatus:
        body = request.model_dump(mode="json", exclude_none=True)
        return JobStatus.model_validate_json((await self._call("POST", "/v1/jobs", json=body)).content)

    async def job(self, job_id: str) -> JobStatus:
        return JobStatus.model_validate_json((await self._call("GET", f"/v1/jobs/{job_id}")).content)

    async def result(self, job_id: str, wait: float = 600.0) -> Trajectory:
        """The finished trajectory; long-polls in rounds of at most 60 s until `wait` has passed."""
        deadline = time.monotonic() + wait
        while True:
            round_s = max(0.0, min(60.0, deadline - time.monotonic()))
            response = await self._call(
                "GET", f"/v1/jobs/{job_id}/result", params={"wait": round_s}, timeout=round_s + self._timeout
            )
            if response.status_code == 200:
                return Trajectory.model_validate_json(response.content)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} did not finish within {wait:g} s")

    async def run(self, request: JobRequest, wait: float = 3600.0) -> Trajectory:
        """Submit and wait for the trajectory. A caller that gives up (timeout, cancellation, an error) cancels
        the job, so that its sandbox does not run on for nobody."""
        job = await self.submit(request)
        try:
            return await self.result(job.job_id, wait)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.cancel(job.job_id))
            raise

    async def run_many(self, requests: list[JobRequest], wait: float = 3600.0) -> list[Trajectory]:
        return list(await asyncio.gather(*(self.run(r, wait) for r in requests)))

    # -- decoupled mode -------------------------------------------------------------------------------
    async def enqueue_prompts(self, requests: list[JobRequest]) -> int:
        """Queue upcoming episodes; the service starts them as admission control allows."""
        body = PromptsRequest(requests=requests).model_dump(mode="json", exclude_none=True)
        return (await self._call("POST", "/v1/prompts", json=body)).json()["upcoming"]

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
        response = await self._call(
            "POST", "/v1/batches", json=body.model_dump(mode="json", exclude_none=True), timeout=wait
        )
        return Batch.model_validate_json(response.content)

    async def ack(self, ids: list[str]) -> int:
        body = AckRequest(ids=ids).model_dump()
        return (await self._call("POST", "/v1/batches/ack", json=body)).json()["acknowledged"]

    async def buffer(self) -> dict:
        return (await self._call("GET", "/v1/buffer")).json()

    async def cancel(self, job_id: str) -> JobStatus:
        return JobStatus.model_validate_json((await self._call("DELETE", f"/v1/jobs/{job_id}")).content)

    async def tasks(self) -> list[str]:
        """The names of the tasks the service can run."""
        return (await self._call("GET", "/v1/tasks")).json()["tasks"]

    async def plugins(self) -> dict:
        """The service's plugins (`plugins`: name and hooks of each) and its plugin configuration (`config`)."""
        return (await self._call("GET", "/v1/plugins")).json()

    async def status(self) -> dict:
        return (await self._call("GET", "/v1/status")).json()

    async def set_policy_version(self, version: int, raise_only: bool = False) -> int:
        """Publish the trainer's policy version; returns the version in effect (with `raise_only`, a lower
        one than asked is never set: several trainer workers may publish the same steps out of order)."""
        body = PolicyVersion(version=version, raise_only=raise_only).model_dump()
        return (await self._call("PUT", "/v1/policy-version", json=body)).json()["version"]

    async def llm_servers(self) -> list[dict]:
        return (await self._call("GET", "/v1/llm-servers")).json()["servers"]

    async def add_llm_server(self, url: str) -> dict:
        return (await self._call("POST", "/v1/llm-servers", json={"url": url})).json()

    async def remove_llm_server(self, url: str) -> bool:
        """Remove one server; False if it was not there (not an error)."""
        return (await self._call("DELETE", "/v1/llm-servers", params={"url": url})).json()["removed"]

    async def set_llm_servers(self, urls: list[str]) -> list[dict]:
        """Make `urls` the service's whole set of LLM servers, in one idempotent call."""
        body = LLMServersRequest(urls=urls).model_dump()
        return (await self._call("PUT", "/v1/llm-servers", json=body)).json()["servers"]


class SyncRolloutClient:
    """The same calls, blocking; each one runs the async client on a private event loop."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = RolloutClient(base_url, token, timeout)

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
