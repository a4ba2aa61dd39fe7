"""The prompt queue on Redis: upcoming prompts and the record of admitted ones outlive the service.

Keys (prefix default `prorl:prompts`):
- `{prefix}:upcoming`: a list of JobRequest JSON documents, each with its job id, in order;
- `{prefix}:running`: a hash, job id -> the JobRequest JSON of a prompt admitted and not yet delivered;
- `{prefix}:owner`: a hash, job id -> the replica running it;
- `{prefix}:version`: a hash, job id -> the policy version it was admitted at;
- `{prefix}:versions`: a hash, version -> how many running prompts were admitted at it (for admission control).

`pop` moves the head of the list into the running records in one Lua script, so a crash between the two cannot
lose a prompt; under a fence (`coordination.AdmissionFence`, the admission lock's key on this same Redis) the
script first checks that the lock still holds the fence's token and renews it, or moves nothing. `push` is one
RPUSH of every prompt: all or none. `done` deletes them once its trajectory is in the experience buffer. A
replica that starts on the same Redis takes back what is recorded as its own (`recover`: an earlier
incarnation's, or a pop whose reply was lost) and runs it again, and the replica that takes over a dead one takes
its prompts (`take_over`): delivery is at least once. A running record with no owner (written before owners
were recorded) is anyone's to recover. Errors are the experience buffer's: `BufferUnavailable` when Redis cannot
be reached (the producer waits it out), `ExperienceBufferError` when Redis refuses a command.
"""

from __future__ import annotations

from ...models import JobRequest
from .coordination import AdmissionFence, AdmissionLapsed
from .prompts import PromptQueue, check_fence, with_job_id
from .redis_connection import RedisConnection

_POP = """
-- KEYS: upcoming list, running, owner, version, versions hashes[, the admission lock]; ARGV: replica, version[,
-- the hold's token, the lock's lifetime in ms]. The JSON moved, or false when none is upcoming. Fenced (the lock
-- given): 0, and nothing moves, unless the lock still holds the token; if it does, it is renewed.
if KEYS[6] then
  if redis.call('GET', KEYS[6]) ~= ARGV[3] then return 0 end
  redis.call('PEXPIRE', KEYS[6], ARGV[4])
end
local document = redis.call('LPOP', KEYS[1])
if not document then return false end
local id = cjson.decode(document)['job_id']
local known = redis.call('HEXISTS', KEYS[2], id) == 1  -- a prompt pushed twice runs once, and counts once
redis.call('HSET', KEYS[2], id, document)
redis.call('HSET', KEYS[3], id, ARGV[1])
if not known then
  redis.call('HSET', KEYS[4], id, ARGV[2])
  redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
end
return document
"""

_DONE = """
-- KEYS: running, owner, version, versions hashes; ARGV: job id, this replica. A replica that lost the prompt to
-- another (it was taken for dead) does not end the other's run of it.
local owner = redis.call('HGET', KEYS[2], ARGV[1])
if owner and owner ~= ARGV[2] then return 0 end
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
local version = redis.call('HGET', KEYS[3], ARGV[1])
if version then
  redis.call('HDEL', KEYS[3], ARGV[1])
  if redis.call('HINCRBY', KEYS[4], version, -1) <= 0 then redis.call('HDEL', KEYS[4], version) end
end
return 1
"""

_CLAIM = """
-- KEYS: running, owner hashes; ARGV: the owner whose prompts are claimed, the claimer. The claimed documents;
-- the claimer's recovery (ARGV[1] == ARGV[2]) also takes prompts recorded with no owner.
local out = {}
local running = redis.call('HGETALL', KEYS[1])
for i = 1, #running, 2 do
  local owner = redis.call('HGET', KEYS[2], running[i])
  if owner == ARGV[1] or (not owner and ARGV[1] == ARGV[2]) then
    redis.call('HSET', KEYS[2], running[i], ARGV[2])
    out[#out + 1] = running[i + 1]
  end
end
return out
"""


class RedisPromptQueue(PromptQueue):
    def __init__(
        self, url: str, replica: str = "prorl-rollout", *, prefix: str = "prorl:prompts", socket_timeout: float = 5.0
    ) -> None:
        # No silent retries: a pop whose reply was lost has moved its prompt to `running`; retried, it would move
        # another, and nobody would know of the first. The error reaches the producer, which takes back what
        # runs there and not in this process (`recover`), and waits out the outage itself.
        self._connection = RedisConnection(url, socket_timeout=socket_timeout, retries=0)
        self.replica = replica
        self._upcoming = f"{prefix}:upcoming"
        self._running = f"{prefix}:running"
        self._records = [self._running, f"{prefix}:owner", f"{prefix}:version", f"{prefix}:versions"]
        redis = self._connection.redis
        self._pop, self._done, self._claim = (redis.register_script(s) for s in (_POP, _DONE, _CLAIM))

    @property
    def redis_server(self) -> str:
        return self._connection.server

    async def push(self, requests: list[JobRequest]) -> int:
        documents = [with_job_id(r).model_dump_json(exclude_none=True) for r in requests]
        with self._connection.errors(f"RPUSH to {self._upcoming}"):
            return (
                int(await self._connection.redis.rpush(self._upcoming, *documents)) if documents else await self.size()
            )

    async def pop(self, version: int, fence: AdmissionFence | None = None) -> JobRequest | None:
        keys, args = [self._upcoming, *self._records], [self.replica, version]
        if fence is not None:
            check_fence(self, fence)
            keys.append(fence.key)
            args += [fence.token, fence.renew_ms]
        with self._connection.errors(f"moving a prompt from {self._upcoming} to {self._running}"):
            document = await self._pop(keys=keys, args=args)
        if document == 0 and fence is not None:
            raise AdmissionLapsed(f"the admission lock {fence.key} lapsed before a pop made under it")
        return JobRequest.model_validate_json(document) if document else None

    async def done(self, job_id: str) -> None:
        with self._connection.errors(f"deleting {job_id} from {self._running}"):
            await self._done(keys=self._records, args=[job_id, self.replica])

    async def recover(self) -> list[JobRequest]:
        return await self._claimed(self.replica)

    async def take_over(self, replica_id: str) -> list[JobRequest]:
        return await self._claimed(replica_id)

    async def _claimed(self, owner: str) -> list[JobRequest]:
        with self._connection.errors(f"claiming the prompts of {owner} in {self._running}"):
            documents = await self._claim(keys=self._records[:2], args=[owner, self.replica])
        return [JobRequest.model_validate_json(d) for d in documents]

    async def running_versions(self) -> dict[int, int]:
        with self._connection.errors(f"HGETALL {self._records[3]}"):
            counts = await self._connection.redis.hgetall(self._records[3])
        return {int(v): int(n) for v, n in sorted(counts.items(), key=lambda kv: int(kv[0])) if int(n) > 0}

    async def size(self) -> int:
        with self._connection.errors(f"LLEN of {self._upcoming}"):
            return int(await self._connection.redis.llen(self._upcoming))

    async def close(self) -> None:
        await self._connection.close()
