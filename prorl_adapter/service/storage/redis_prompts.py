"""The prompt queue on Redis: upcoming prompts and the record of admitted ones outlive the service.

Keys (prefix default `prorl:prompts`):
- `{prefix}:upcoming`: a list of JobRequest JSON documents, each with its job id, in order;
- `{prefix}:running`: a hash, job id -> the JobRequest JSON of a prompt admitted and not yet delivered.

`pop` moves the head of the list into the hash in one Lua script, so a crash between the two cannot lose a
prompt; `done` deletes it from the hash once its trajectory is in the experience buffer. A service that starts
on the same Redis takes back what is in the hash (`recover`) and runs it again: delivery is at least once.
Errors are the experience buffer's: `BufferUnavailable` when Redis cannot be reached (the producer waits it
out), `ExperienceBufferError` when Redis refuses a command.
"""

from __future__ import annotations

from ...models import JobRequest
from .prompts import PromptQueue, with_job_id
from .redis_connection import RedisConnection

_POP = """
-- KEYS: upcoming list, running hash. Returns the JSON of the prompt moved, or false.
local document = redis.call('LPOP', KEYS[1])
if not document then return false end
redis.call('HSET', KEYS[2], cjson.decode(document)['job_id'], document)
return document
"""


class RedisPromptQueue(PromptQueue):
    def __init__(self, url: str, *, prefix: str = "prorl:prompts", socket_timeout: float = 5.0) -> None:
        # No silent retries: a pop whose reply was lost has moved its prompt to `running`; retried, it would move
        # another, and nobody would know of the first. The error reaches the producer, which takes back what
        # runs there and not in this process (`recover`), and waits out the outage itself.
        self._connection = RedisConnection(url, socket_timeout=socket_timeout, retries=0)
        self._upcoming = f"{prefix}:upcoming"
        self._running = f"{prefix}:running"
        self._pop = self._connection.redis.register_script(_POP)

    async def push(self, requests: list[JobRequest]) -> int:
        documents = [with_job_id(r).model_dump_json(exclude_none=True) for r in requests]
        with self._connection.errors(f"RPUSH to {self._upcoming}"):
            return (
                int(await self._connection.redis.rpush(self._upcoming, *documents)) if documents else await self.size()
            )

    async def pop(self) -> JobRequest | None:
        with self._connection.errors(f"moving a prompt from {self._upcoming} to {self._running}"):
            document = await self._pop(keys=[self._upcoming, self._running])
        return JobRequest.model_validate_json(document) if document else None

    async def done(self, job_id: str) -> None:
        with self._connection.errors(f"HDEL from {self._running}"):
            await self._connection.redis.hdel(self._running, job_id)

    async def recover(self) -> list[JobRequest]:
        with self._connection.errors(f"HVALS of {self._running}"):
            documents = await self._connection.redis.hvals(self._running)
        return [JobRequest.model_validate_json(d) for d in documents]

    async def size(self) -> int:
        with self._connection.errors(f"LLEN of {self._upcoming}"):
            return int(await self._connection.redis.llen(self._upcoming))

    async def close(self) -> None:
        await self._connection.close()
