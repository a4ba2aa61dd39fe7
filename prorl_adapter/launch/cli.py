"""`prorl-rollout ray up|down|status`: the rollout stack on a running Ray cluster, from a shell.

`up` starts the stack as detached actors and prints its description (the service URLs and the token a trainer
needs) as JSON, then leaves it running; `down` takes it down, whichever driver started it; `status` prints
the description with each part's state now. `add_ray_parser` adds these to `prorl-rollout`'s parser, and
`run_ray` runs them; Ray is imported only when one runs, so `prorl-rollout` works without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

DEFAULT_NAMESPACE = "prorl"  # ray_stack.DEFAULT_NAMESPACE, without importing Ray to build a parser


def _ids(text: str) -> list[str]:
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if not ids:
        raise argparse.ArgumentTypeError("a comma-separated list of Ray node ids")
    return ids


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1")
    return value


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="auto", help="the Ray cluster (default: %(default)s, the running one)")
    parser.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help="the stack's Ray namespace (default: %(default)s)"
    )


def add_ray_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `ray up|down|status` to `subparsers` (of `prorl-rollout`'s parser); returns the `ray` parser."""
    parser = subparsers.add_parser("ray", help="start, inspect or stop the rollout stack on a Ray cluster")
    sub = parser.add_subparsers(dest="ray_command", required=True)
    up = sub.add_parser("up", help="start Redis, the rollout service replicas and a sandbox runtime per node")
    _cluster_arguments(up)
    up.add_argument("--tokenizer", required=True, help="path or name of the policy's tokenizer")
    up.add_argument("--llm-url", action="append", default=[], help="an LLM server (repeatable; or set them later)")
    up.add_argument("--replicas", type=_positive, default=1, help="rollout service replicas (default: %(default)s)")
    where = up.add_mutually_exclusive_group()
    where.add_argument("--runtime-resource", help="run a sandbox runtime on each node with this custom resource")
    where.add_argument("--runtime-nodes", type=_ids, help="ID,...: on these Ray nodes")
    where.add_argument("--runtime-label", help="KEY=VALUE: on the nodes with this Ray label")
    up.add_argument("--service-nodes", type=_ids, help="ID,...: the replicas' nodes (default: every node, head first)")
    up.add_argument("--redis-url", help="use this Redis for the buffer instead of starting one")
    up.add_argument(
        "--token",
        default=os.environ.get("PRORL_ROLLOUT_TOKEN"),
        help="the one token of every part (default: env PRORL_ROLLOUT_TOKEN, else a new random one)",
    )
    up.add_argument("--service-args", type=shlex.split, default=[], help="more `prorl-rollout serve` arguments, quoted")
    up.add_argument("--runtime-args", type=shlex.split, default=[], help="more `prorl-sandbox serve` arguments, quoted")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds each part may take to answer")
    for name, what in (
        ("down", "stop every part and remove the stack's actors"),
        ("status", "print each part's state"),
    ):
        _cluster_arguments(sub.add_parser(name, help=what))
    return parser


def run_ray(args: argparse.Namespace) -> int:
    """Run `ray up|down|status`: 0 done, 1 a stack that failed or has parts down, 2 no Ray or no stack."""
    try:
        import ray

        from . import ray_stack
    except ImportError as exc:
        print(f"prorl-rollout ray: Ray is not installed here ({exc}); pip install ray", file=sys.stderr)
        return 2
    try:
        ray.init(address=args.address, namespace=args.namespace, log_to_driver=False, logging_level="WARNING")
    except ConnectionError as exc:
        print(f"prorl-rollout ray: no Ray cluster at {args.address}: {exc}", file=sys.stderr)
        return 2
    try:
        return _COMMANDS[args.ray_command](args, ray_stack)
    except ray_stack.NoStack as exc:
        print(f"prorl-rollout ray: {exc}", file=sys.stderr)
        return 2
    except ray_stack.StackError as exc:
        print(f"prorl-rollout ray: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()


def _up(args: argparse.Namespace, ray_stack) -> int:
    stack = ray_stack.RayStack.up(
        tokenizer=args.tokenizer,
        llm_urls=args.llm_url,
        replicas=args.replicas,
        runtime_resource=args.runtime_resource,
        runtime_nodes=args.runtime_nodes,
        runtime_label=args.runtime_label,
        service_nodes=args.service_nodes,
        redis_url=args.redis_url,
        token=args.token,
        service_args=args.service_args,
        runtime_args=args.runtime_args,
        namespace=args.namespace,
        detached=True,
        timeout_s=args.timeout,
    )
    print(json.dumps(stack.describe(), indent=2))
    return 0


def _down(args: argparse.Namespace, ray_stack) -> int:
    stopped = ray_stack.down(args.namespace)
    print(json.dumps({"namespace": args.namespace, "stopped": stopped}, indent=2))
    return 0


def _status(args: argparse.Namespace, ray_stack) -> int:
    status = ray_stack.RayStack.attach(args.namespace).status()
    print(json.dumps(status, indent=2))
    return 0 if status.get("parts") and all(p.get("running") for p in status["parts"]) else 1


_COMMANDS = {"up": _up, "down": _down, "status": _status}


def main(argv: list[str] | None = None) -> int:
    """`python -m prorl_adapter.launch.cli ray ...`: the same commands without `prorl-rollout`."""
    parser = argparse.ArgumentParser(prog="prorl-rollout", description=__doc__)
    add_ray_parser(parser.add_subparsers(dest="command", required=True))
    return run_ray(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
