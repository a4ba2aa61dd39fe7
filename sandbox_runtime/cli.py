"""`prorl-sandbox serve`: run the sandbox runtime server standalone.

A start-up failure (a bad flag value, a port in use, a state dir that cannot be used) is one line on stderr that
names the problem and the flag that fixes it, and a non-zero exit status; --debug (or --log-level DEBUG) adds the
traceback."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
from pathlib import Path

from server_kit.address import add_address_arguments
from server_kit.cli import LOG_LEVELS, OneLineParser, Readiness, StartupError, fail, log_level, stopped_by
from server_kit.connections import add_connection_arguments, connection_limits

from . import spawn
from .config import DEFAULT_SANDBOX_UIDS, ServerConfig, default_state_dir, parse_uid_range

PROG = "prorl-sandbox"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the sandbox runtime server")
    add_address_arguments(serve, ServerConfig.port)
    serve.add_argument(
        "--backend",
        choices=["bwrap", "apptainer", "singularity", "local"],
        default=None,
        help="default backend (default: bwrap if installed, else apptainer; local only if named)",
    )
    serve.add_argument(
        "--token",
        default=os.environ.get("PRORL_SANDBOX_TOKEN"),
        help="bearer token required on every request but /healthz (env PRORL_SANDBOX_TOKEN); with --register and "
        "none, a random one is made at start-up and sent only to the services registered with",
    )
    serve.add_argument(
        "--allow-local",
        action="store_true",
        help="offer the `local` backend (no isolation at all) to clients; implied by --backend local",
    )
    serve.add_argument(
        "--image-dir",
        type=Path,
        action="append",
        default=[],
        help="a directory of images (SIF files, OCI layouts, docker save archives, root directories); a spec's "
        "`image` is a name below one of these (repeatable)",
    )
    serve.add_argument(
        "--host-path",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="an absolute host path (a directory or file) that every bwrap sandbox without an image sees, "
        "read-only, at the same path, e.g. /opt/prorl-agent for agent programs (repeatable); beside it such a "
        "sandbox sees only /usr, its own minimal /etc, /dev, /proc, its workspace and /tmp",
    )
    serve.add_argument(
        "--reserve-disk",
        action="store_true",
        help="reserve each sandbox's whole disk_mb on the state disk (a root server): a full state disk never "
        "fails a sandbox's writes, but it holds only as many sandboxes as their limits add up to",
    )
    serve.add_argument(
        "--image-cache-gb",
        type=float,
        default=100.0,
        help="unpacked images kept in the state dir at most; the least recently used that no sandbox runs go "
        "first (default: %(default)g)",
    )
    serve.add_argument(
        "--sandbox-uids",
        type=parse_uid_range,
        default=DEFAULT_SANDBOX_UIDS,
        help="FIRST-LAST: host uids, one per live sandbox, when the server runs as root; nothing else may use "
        f"them (default: {DEFAULT_SANDBOX_UIDS.start}-{DEFAULT_SANDBOX_UIDS.stop - 1})",
    )
    serve.add_argument("--max-sandboxes", type=int, default=1024)
    serve.add_argument(
        "--state-dir",
        type=Path,
        default=default_state_dir(),
        help="workspaces and crash-recovery records (default: %(default)s)",
    )
    serve.add_argument("--apptainer-binary", default=None, help="path of apptainer or singularity")
    serve.add_argument("--fakeroot", action="store_true", help="start Apptainer instances with --fakeroot")
    serve.add_argument(
        "--apptainer-cgroups",
        choices=["auto", "on", "off"],
        default="auto",
        help="--memory and --pids-limit on Apptainer instances: auto where cgroups v2 delegates memory and pids "
        "to this user through systemd (apptainer.conf must also say `systemd cgroups = yes`)",
    )
    serve.add_argument(
        "--register",
        action="append",
        default=[],
        metavar="URL",
        help="a rollout service (or replica) to register with: heartbeats with this runtime's URL and room "
        "(repeatable); services then need no --sandbox-url for it",
    )
    serve.add_argument(
        "--register-token",
        default=os.environ.get("PRORL_REGISTRATION_TOKEN"),
        help="what the services require to register (their --registration-token; env PRORL_REGISTRATION_TOKEN); "
        "presented only to register: the services call this runtime with its own --token, which must differ",
    )
    serve.add_argument(
        "--advertise-url",
        default=None,
        help="where the services reach this runtime (default: http://HOST:PORT, the machine's name for 0.0.0.0)",
    )
    serve.add_argument("--name", default=None, help="how the services know this runtime (default: HOSTNAME-PORT)")
    serve.add_argument("--heartbeat-s", type=float, default=2.0, help="seconds between heartbeats")
    serve.add_argument("--log-level", type=log_level, default="INFO", help=f"one of {', '.join(LOG_LEVELS)}")
    serve.add_argument(
        "--debug", action="store_true", help="log at DEBUG, and show the traceback of a failure to start"
    )
    add_connection_arguments(serve)
    openapi = sub.add_parser("openapi", help="print the API's OpenAPI document, or write it and its reference")
    openapi.add_argument("--out", type=Path, default=None, help="write runtime.json and runtime.md in this folder")
    return parser


def own_token(token: str | None, register: list[str], register_token: str | None) -> str | None:
    """The runtime's API token: --token; a random one when it registers without one (the services learn it from
    its authenticated heartbeats, and nothing else needs it). ValueError for a registration without the
    registration token, or with --token equal to it: every registered runtime holds that one, so it would open
    this runtime's sandboxes to every other."""
    if not register:
        return token
    if not register_token:
        raise ValueError(
            "--register needs the services' registration token: --register-token or env PRORL_REGISTRATION_TOKEN"
        )
    if token == register_token:
        raise ValueError(
            "--token must differ from --register-token: every registered runtime holds the registration "
            "token; leave --token out (and env PRORL_SANDBOX_TOKEN unset) for a random one"
        )
    return token or secrets.token_urlsafe(32)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "openapi":
        from server_kit.openapi import openapi_command

        from .server import RUNTIME_API

        try:
            return openapi_command(RUNTIME_API, args.out)
        except OSError as exc:
            return fail(PROG, f"cannot write the reference: {exc.strerror} ({exc.filename}); fix --out", 1)
    # Whatever its starter left open without close-on-exec reaches no sandbox: sealed before anything else runs.
    spawn.seal_once()
    debug = args.debug or args.log_level == "DEBUG"
    level = "DEBUG" if args.debug else args.log_level
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server_kit.webapp import listen_address

    try:
        listen_socket, host, port = listen_address(args.listen_fd, args.host, args.port, ServerConfig.port)
    except ValueError as exc:
        return fail(PROG, str(exc))
    try:
        token = own_token(args.token, args.register, args.register_token)
    except ValueError as exc:
        return fail(PROG, str(exc))
    config = ServerConfig(
        host=host,
        port=port,
        listen_socket=listen_socket,
        backend=args.backend,
        token=token,
        max_sandboxes=args.max_sandboxes,
        state_dir=args.state_dir,
        apptainer_binary=args.apptainer_binary,
        apptainer_fakeroot=args.fakeroot,
        apptainer_cgroups={"auto": None, "on": True, "off": False}[args.apptainer_cgroups],
        image_dirs=args.image_dir,
        host_paths=args.host_path,
        image_cache_gb=args.image_cache_gb,
        reserve_disk=args.reserve_disk,
        allow_local=args.allow_local or args.backend == "local",
        sandbox_uids=args.sandbox_uids,
        register=args.register,
        register_token=args.register_token,
        advertise_url=args.advertise_url,
        name=args.name,
        heartbeat_s=args.heartbeat_s,
        connections=connection_limits(args),
    )
    try:
        config.check()
        config.connections = config.connections.resolve()
    except ValueError as exc:
        return fail(PROG, str(exc))
    from server_kit.webapp import run_forever

    from .server import serve

    readiness = Readiness()
    try:
        with contextlib.suppress(KeyboardInterrupt):
            run_forever(serve(config, readiness))
    except Exception as exc:
        if isinstance(exc, StartupError):
            line = str(exc)
        elif readiness.ready:
            line = f"stopped by {type(exc).__name__}: {exc} (the traceback is above)"
        else:
            line = f"failed to start: {type(exc).__name__}: {exc} (run again with --debug for the traceback)"
        return stopped_by(PROG, exc, readiness, debug, line)
    return 0
