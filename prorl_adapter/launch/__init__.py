"""Start the whole rollout stack on a running Ray cluster, and take it down again (`prorl-rollout ray ...`).

For users whose trainer (verl, SkyRL) already runs on Ray: one sandbox runtime per selected node, N rollout
service replicas and Redis, each one process started and watched by a small Ray actor on its node. Modules, one
job each: `commands` (the command lines of the parts, and which nodes run what: no Ray), `process` (one server
process: started, awaited, stopped by its process group: no Ray), `ray_stack` (the actors and the stack; the
only module of the project that imports Ray), `cli` (`prorl-rollout ray up|down|status`).
"""
