"""What each part of the stack runs, and on which nodes: pure functions of their parameters, without Ray.

The command lines are the contract with the servers' own CLIs (`prorl-rollout serve`, `prorl-sandbox serve`,
`redis-server`), written once here so that the unit tests check them without a cluster. Every part listens on
its node's address, so every part gets the stack's one token: both servers refuse to listen beyond loopback
without one. Secrets never go on a command line, which any user of a node reads with `ps`: the servers take
their tokens and the Redis URL from the environment (`*_env`), Redis its password from its standard input.
The rollout service replicas share the Redis buffer and need no `--sandbox-url`: the runtimes register
themselves with every replica.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from server_kit.errors import ProrlError

REDIS, SERVICE, RUNTIME = "redis", "service", "runtime"
START_ORDER = (REDIS, SERVICE, RUNTIME)  # each part needs the ones before it
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives its head node only


def host_in_url(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def http_url(ip: str, port: int) -> str:
    return f"http://{host_in_url(ip)}:{port}"


def redis_url(ip: str, port: int, token: str) -> str:
    return f"redis://:{quote(token, safe='')}@{host_in_url(ip)}:{port}/0"


def service_id(index: int) -> str:
    """The replica's `--service-id`: it labels the replica's sandboxes, and a restart with the same id deletes
    what the last run of that replica left."""
    return f"prorl-rollout-{index}"


def redis_argv(binary: str, ip: str, port: int) -> list[str]:
    """A Redis that keeps nothing on disk (the buffer lives as long as the stack), reading the rest of its
    configuration, the password, from its standard input (`-`: `redis_config`)."""
    return [
        binary,
        "-",
        "--port",
        str(port),
        "--bind",
        ip,
        "--protected-mode",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
    ]


def redis_config(token: str) -> str:
    """What Redis reads on its standard input: the password, quoted as its configuration files quote."""
    quoted = token.replace("\\", "\\\\").replace('"', '\\"')
    return f'requirepass "{quoted}"\n'


def service_env(token: str, buffer_url: str) -> dict[str, str]:
    """A replica's secrets, read by its CLI from the environment: its token, the runtimes', the Redis URL."""
    return {
        "PRORL_ROLLOUT_TOKEN": token,
        "PRORL_SANDBOX_TOKEN": token,
        "PRORL_REGISTRATION_TOKEN": token,
        "PRORL_BUFFER_URL": buffer_url,
    }


def runtime_env(token: str) -> dict[str, str]:
    """A runtime's secret: the services' registration token, presented only to register. Its own API token is
    one it makes at start-up and sends the services in its heartbeats, so no runtime holds another's; it is given
    no API token of the services either: it needs none."""
    return {"PRORL_REGISTRATION_TOKEN": token}


def listen_args(ip: str, port: int, listen_fd: int | None) -> list[str]:
    """Where a server of ours listens: on the socket it inherits as `listen_fd`, bound on ip:port by its starter
    (nothing can take the port before the server starts), else on ip:port, which it binds itself."""
    return ["--host", ip, "--port", str(port)] if listen_fd is None else ["--listen-fd", str(listen_fd)]


def service_argv(
    python: str,
    ip: str,
    port: int,
    *,
    index: int,
    tokenizer: str,
    llm_urls: Sequence[str] = (),
    extra: Sequence[str] = (),
    listen_fd: int | None = None,
) -> list[str]:
    argv = [python, "-m", "prorl_adapter", "serve", *listen_args(ip, port, listen_fd)]
    argv += ["--service-id", service_id(index), "--advertise-url", http_url(ip, port), "--gateway-host", ip]
    argv += ["--tokenizer", tokenizer]
    argv += [arg for url in llm_urls for arg in ("--llm-url", url)]
    return argv + list(extra)


def runtime_argv(
    python: str,
    ip: str,
    port: int,
    *,
    service_urls: Sequence[str],
    state_dir: Path | str,
    extra: Sequence[str] = (),
    listen_fd: int | None = None,
) -> list[str]:
    argv = [python, "-m", "sandbox_runtime", "serve", *listen_args(ip, port, listen_fd)]
    argv += ["--advertise-url", http_url(ip, port)]
    argv += [arg for url in service_urls for arg in ("--register", url)]
    argv += ["--state-dir", str(state_dir)]
    return argv + list(extra)


# -- which nodes run what, from `ray.nodes()` ----------------------------------------------------------------
class PlacementError(ProrlError, ValueError):
    """No node, or an unknown node, for a part; the message says which selection found nothing."""


@dataclass(frozen=True)
class Placement:
    """The node ids each part runs on: Redis (None: a given URL), one per service replica, one per runtime."""

    redis: str | None
    services: tuple[str, ...]
    runtimes: tuple[str, ...]


def alive(nodes: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The alive nodes, the head first, the others in node id order: the same plan for the same cluster."""
    found = [n for n in nodes if n.get("Alive")]
    return sorted(found, key=lambda n: (HEAD_RESOURCE not in n.get("Resources", {}), n["NodeID"]))


def _label(selector: str) -> tuple[str, str]:
    key, equals, value = selector.partition("=")
    if not equals or not key:
        raise PlacementError(f"runtime label {selector!r}: write KEY=VALUE")
    return key, value


def runtime_nodes(
    nodes: Sequence[Mapping[str, Any]],
    resource: str | None = None,
    node_ids: Sequence[str] | None = None,
    label: str | None = None,
) -> list[str]:
    """The nodes that get a sandbox runtime: those with the custom `resource`, or those named, or those whose
    Ray label is `label` (KEY=VALUE), or, with none of these, every alive node."""
    if sum(x is not None for x in (resource, node_ids, label)) > 1:
        raise PlacementError("select the runtime nodes one way: a resource, node ids or a label")
    nodes = alive(nodes)
    if node_ids is not None:
        return _named(nodes, node_ids, "runtime")
    if resource is not None:
        chosen = [n["NodeID"] for n in nodes if n.get("Resources", {}).get(resource, 0) > 0]
        what = f"with the resource {resource!r} (ray start --resources='{{\"{resource}\": 1}}')"
    elif label is not None:
        key, value = _label(label)
        chosen = [n["NodeID"] for n in nodes if (n.get("Labels") or {}).get(key) == value]
        what = f"with the label {label}"
    else:
        chosen, what = [n["NodeID"] for n in nodes], "at all"
    if not chosen:
        raise PlacementError(f"no alive node {what} for the sandbox runtimes")
    return chosen


def _named(nodes: Sequence[Mapping[str, Any]], node_ids: Sequence[str], part: str) -> list[str]:
    known = {n["NodeID"] for n in nodes}
    unknown = [i for i in node_ids if i not in known]
    if unknown:
        raise PlacementError(f"{part} nodes {', '.join(unknown)} are not alive nodes of the cluster (`ray status`)")
    if not node_ids:
        raise PlacementError(f"no {part} nodes named")
    return list(dict.fromkeys(node_ids))


def place(
    nodes: Sequence[Mapping[str, Any]],
    *,
    replicas: int,
    with_redis: bool,
    service_nodes: Sequence[str] | None = None,
    runtime_resource: str | None = None,
    runtime_node_ids: Sequence[str] | None = None,
    runtime_label: str | None = None,
) -> Placement:
    """Redis on the head node; the replicas round-robin over `service_nodes` (default: every alive node, the
    head first); the runtimes as `runtime_nodes` selects them."""
    if replicas < 1:
        raise PlacementError(f"replicas={replicas}: at least one rollout service replica")
    ordered = alive(nodes)
    if not ordered:
        raise PlacementError("the cluster has no alive node")
    hosts = _named(ordered, service_nodes, "service") if service_nodes is not None else [n["NodeID"] for n in ordered]
    return Placement(
        redis=ordered[0]["NodeID"] if with_redis else None,
        services=tuple(hosts[i % len(hosts)] for i in range(replicas)),
        runtimes=tuple(runtime_nodes(ordered, runtime_resource, runtime_node_ids, runtime_label)),
    )
