"""`prorl-rollout serve` runs the rollout service; `prorl-rollout plugins` lists what is loaded;
`prorl-rollout openapi` prints (or writes) the API's OpenAPI document."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from sandbox_runtime.config import add_address_arguments
from sandbox_runtime.connections import add_connection_arguments, connection_limits

from ..hooks.manager import read_plugin_config
from ..launch.cli import add_ray_parser, run_ray
from .adaptive_concurrency import AdaptiveConfig
from .config import RolloutConfig
from .decoupled import ProducerConfig
from .pipeline import PipelineConfig
from .warm_sandboxes import WarmConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prorl-rollout", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the rollout service")
    serve.add_argument(
        "--sandbox-url",
        action="append",
        default=[],
        help="a sandbox runtime server (repeatable); runtimes started with --register URL need none",
    )
    serve.add_argument(
        "--llm-url",
        action="append",
        default=[],
        help="an LLM server (repeatable): vLLM, SGLang (sglang+http://...) or ProRL /generate (prorl+http://...); "
        "a plain URL is probed. None: add them through the API (PUT /v1/llm-servers, ProRL's /add_llm_server)",
    )
    serve.add_argument("--tokenizer", required=True, help="path or name of the policy's tokenizer")
    add_address_arguments(serve, RolloutConfig.port)
    serve.add_argument("--token", default=os.environ.get("PRORL_ROLLOUT_TOKEN"), help="env PRORL_ROLLOUT_TOKEN")
    serve.add_argument(
        "--sandbox-token",
        default=os.environ.get("PRORL_SANDBOX_TOKEN"),
        help="the token of the runtimes given by --sandbox-url (env PRORL_SANDBOX_TOKEN)",
    )
    serve.add_argument(
        "--registration-token",
        default=os.environ.get("PRORL_REGISTRATION_TOKEN"),
        help="what a runtime started with --register must present (env PRORL_REGISTRATION_TOKEN; default: the "
        "sandbox token; with neither, no runtime may register); a registered runtime is called with its own token",
    )
    serve.add_argument("--timeout", type=float, default=1800.0, help="default time budget of a job, in seconds")
    serve.add_argument("--max-init-workers", type=int, default=32)
    serve.add_argument(
        "--max-run-workers",
        type=int,
        default=256,
        help="episodes in the run stage at once; with --target-engine-batch, the most (default %(default)s)",
    )
    adaptive = AdaptiveConfig()
    serve.add_argument(
        "--target-engine-batch",
        type=int,
        default=adaptive.target_engine_batch,
        metavar="N",
        help="size the run stage's episodes in flight to keep each LLM server's engine batch (vLLM's /metrics: "
        "running + waiting requests) near N, between --min-run-workers and --max-run-workers; servers without "
        "vLLM metrics get a fixed share (default %(default)s: off, a fixed --max-run-workers)",
    )
    serve.add_argument(
        "--min-run-workers",
        type=int,
        default=adaptive.min_run_workers,
        help="with --target-engine-batch: the fewest episodes the run stage may be limited to (default %(default)s)",
    )
    serve.add_argument(
        "--engine-poll-s",
        type=float,
        default=adaptive.poll_s,
        help="with --target-engine-batch: seconds between reads of the LLM servers' /metrics (default %(default)s)",
    )
    serve.add_argument("--max-eval-workers", type=int, default=32)
    serve.add_argument("--plugin", action="append", default=[], help="import path of a plugin (repeatable)")
    serve.add_argument("--block-plugin", action="append", default=[], help="name of a plugin not to load")
    serve.add_argument(
        "--buffer",
        default=os.environ.get("PRORL_BUFFER_URL", "memory://"),
        help="the service's state (experience buffer, upcoming prompts, jobs, runtimes, policy version): "
        "memory:// or redis://host:port/db (survives a restart; replicas given the same URL share the work); "
        "env PRORL_BUFFER_URL (keeps a Redis password off the command line)",
    )
    defaults = ProducerConfig()
    serve.add_argument(
        "--lease-s",
        type=float,
        default=defaults.lease_s,
        help="how long a taken batch may stay unacknowledged before its entries are delivered again "
        "(default %(default)s; POST /v1/batches may ask otherwise)",
    )
    serve.add_argument(
        "--max-deliveries",
        type=int,
        default=defaults.max_deliveries,
        help="deliveries after which an unacknowledged entry is a dead letter (default %(default)s)",
    )
    serve.add_argument(
        "--max-buffered",
        type=int,
        default=defaults.max_buffered,
        help="admission pauses while the buffer holds this many entries (default %(default)s)",
    )
    serve.add_argument("--plugin-config", type=Path, default=None, help="JSON file: plugin settings by section")
    serve.add_argument(
        "--service-id",
        default=None,
        help="this replica's id: labels its sandboxes; a restart with the same id takes back what the last run "
        "left; replicas sharing a Redis need distinct ids (default: prorl-rollout@HOSTNAME:PORT)",
    )
    serve.add_argument(
        "--advertise-url",
        default=None,
        help="where other machines reach this replica, as /v1/status shows it (default: http://HOST:PORT)",
    )
    serve.add_argument(
        "--result-ttl-s",
        type=float,
        default=86_400.0,
        help="with a Redis --buffer: how long a finished job's result stays readable (default %(default)s)",
    )
    serve.add_argument(
        "--gateway-host", default=None, help="where the LLM gateway for agent programs listens (default: --host)"
    )
    serve.add_argument("--gateway-port", type=int, default=0, help="its port (default: a free one)")
    serve.add_argument(
        "--gateway-address",
        default=None,
        help="HOST:PORT at which the sandbox runtimes reach the gateway (default: its own address, 127.0.0.1 when "
        "it listens on all interfaces); give it where runtimes on other machines must reach it",
    )
    warm = WarmConfig()
    serve.add_argument(
        "--warm-sandboxes",
        type=int,
        default=warm.size,
        metavar="N",
        help="keep N sandboxes created ahead for each sandbox spec episodes ask for, each used once "
        "(default %(default)s: off)",
    )
    serve.add_argument(
        "--warm-refill-per-s",
        type=float,
        default=warm.refill_per_s,
        help="warm sandboxes created per second at most, all specs together (default %(default)s)",
    )
    serve.add_argument(
        "--warm-max-specs",
        type=int,
        default=warm.max_specs,
        help="specs kept warm; the least recently asked is dropped, its warm sandboxes deleted (default %(default)s)",
    )
    serve.add_argument(
        "--warm-max-age-s",
        type=float,
        default=warm.max_age_s,
        help="a warm sandbox older than this is deleted instead of handed out (default %(default)s)",
    )
    serve.add_argument(
        "--max-concurrent-creates",
        type=int,
        default=0,
        help="sandbox creations in flight on one runtime from this replica at most, episodes' before warm "
        "refills (default %(default)s: no limit)",
    )
    serve.add_argument("--log-level", default="INFO")
    add_connection_arguments(serve)
    plugins = sub.add_parser("plugins", help="list the plugins and task handlers that would be loaded")
    plugins.add_argument("--plugin", action="append", default=[])
    plugins.add_argument("--block-plugin", action="append", default=[])
    plugins.add_argument("--plugin-config", type=Path, default=None, help="check this plugin configuration too")
    openapi = sub.add_parser("openapi", help="print the API's OpenAPI document, or write it and its reference")
    openapi.add_argument(
        "--out", type=Path, default=None, help="write rollout.{json,md} and gateway.{json,md} in this folder"
    )
    openapi.add_argument("--gateway", action="store_true", help="print the LLM gateway's document instead")
    add_ray_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "ray":
        return run_ray(args)
    if args.command == "plugins":
        return list_plugins(args.plugin, args.block_plugin, args.plugin_config)
    if args.command == "openapi":
        from sandbox_runtime.openapi import openapi_command

        from .gateway import GATEWAY_API
        from .server import ROLLOUT_API

        if args.out is None:
            return openapi_command(GATEWAY_API if args.gateway else ROLLOUT_API, None)
        return openapi_command(ROLLOUT_API, args.out) or openapi_command(GATEWAY_API, args.out)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from sandbox_runtime.webapp import listen_address

    try:
        listen_socket, host, port = listen_address(args.listen_fd, args.host, args.port, RolloutConfig.port)
    except ValueError as exc:
        print(f"prorl-rollout: {exc}")
        return 2
    config = RolloutConfig(
        sandbox_urls=args.sandbox_url,
        llm_urls=args.llm_url,
        tokenizer=args.tokenizer,
        host=host,
        port=port,
        listen_socket=listen_socket,
        token=args.token,
        sandbox_token=args.sandbox_token,
        registration_token=args.registration_token,
        connections=connection_limits(args),
        pipeline=PipelineConfig(
            max_init_workers=args.max_init_workers,
            max_run_workers=args.max_run_workers,
            max_eval_workers=args.max_eval_workers,
            default_timeout_s=args.timeout,
            gateway_address=args.gateway_address,
            adaptive=AdaptiveConfig(
                target_engine_batch=args.target_engine_batch,
                min_run_workers=args.min_run_workers,
                poll_s=args.engine_poll_s,
            ),
        ),
        plugins=args.plugin,
        blocked_plugins=args.block_plugin,
        buffer_url=args.buffer,
        decoupled=ProducerConfig(
            lease_s=args.lease_s, max_deliveries=args.max_deliveries, max_buffered=args.max_buffered
        ),
        service_id=args.service_id,
        advertise_url=args.advertise_url,
        result_ttl_s=args.result_ttl_s,
        gateway_host=args.gateway_host or host,
        gateway_port=args.gateway_port,
        warm=WarmConfig(
            size=args.warm_sandboxes,
            refill_per_s=args.warm_refill_per_s,
            max_specs=args.warm_max_specs,
            max_age_s=args.warm_max_age_s,
        ),
        max_concurrent_creates=args.max_concurrent_creates,
    )
    try:
        config.plugin_config = read_plugin_config(args.plugin_config)
        config.check()
        config.connections = config.connections.resolve(sites=2)  # the API and the gateway
    except ValueError as exc:
        print(f"prorl-rollout: {exc}")
        return 2
    from sandbox_runtime.webapp import run_forever

    from .server import serve

    run_forever(serve(config))
    return 0


def list_plugins(paths: list[str], blocked: list[str], config_file: Path | None = None) -> int:
    """Print the plugins, their hooks and the tasks; with a config file, also check it as start-up would."""
    from ..hooks import PluginConfigError, PluginLoadError, PluginSet

    try:
        config = read_plugin_config(config_file)
        plugins = PluginSet.load(config, paths, blocked=blocked)
        tasks = plugins.tasks()
    except (PluginLoadError, PluginConfigError, ValueError) as exc:
        print(f"prorl-rollout: {exc}")
        return 2
    for plugin in plugins.describe():
        if plugin["plugin"] == "blocked":
            print(f"{plugin['name']}: blocked")
            continue
        print(f"{plugin['name']}: {plugin['plugin']} hooks={','.join(plugin['hooks'])}")
    for name, handler in sorted(tasks.items()):
        print(f"task {name}: {type(handler).__module__}.{type(handler).__name__}")
    if config_file is not None:
        print(f"configuration {config_file}: accepted")
    return 0
