"""`prorl-rollout serve` runs the rollout service; `prorl-rollout plugins` lists what is loaded;
`prorl-rollout openapi` prints (or writes) the API's OpenAPI document.

A start-up failure of `serve` (a bad flag value, a tokenizer that cannot be loaded, a port in use) is one line on
stderr that names the problem and the flag that fixes it, and a non-zero exit status; --debug (or --log-level
DEBUG) adds the traceback."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from server_kit.address import add_address_arguments
from server_kit.cli import LOG_LEVELS, OneLineParser, Readiness, StartupError, fail, log_level, stopped_by
from server_kit.connections import add_connection_arguments, connection_limits

from ..hooks.manager import PluginConfigError, PluginLoadError, read_plugin_config
from ..launch.cli import add_ray_parser, run_ray
from .adaptive_concurrency import AdaptiveConfig
from .chat import TokenizerError
from .circuit_breaker import BreakerConfig
from .config import RolloutConfig
from .decoupled import ProducerConfig
from .pipeline import PipelineConfig
from .records_cli import add_records_parsers, run_export, run_import
from .records_viewer import add_view_parser, run_view
from .storage import REDIS_SCHEMES
from .warm_sandboxes import WarmConfig

# The tokenizer of the tiny model `make demo` builds and the local CPU vLLM serves (prorl_adapter.dev.localstack).
TINY_TOKENIZER = "models/tiny-qwen2"
# What a tokenizer's directory holds, one of these sets of files: a fast tokenizer's tokenizer.json, a config
# that names one, a BPE vocabulary with its merges (GPT-2 style), or a SentencePiece model.
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer_config.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))
PROG = "prorl-rollout"


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} must be >= {low}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__)
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
    serve.add_argument(
        "--llm-stream",
        action="store_true",
        help="read each turn from vLLM as a stream, counting its tokens as they arrive: what a weight-update barrier "
        "in mode 'keep' needs (it costs the service CPU per token)",
    )
    serve.add_argument(
        "--llm-outage-wait-s",
        type=_positive_float,
        default=RolloutConfig.llm_outage_wait_s,
        metavar="S",
        help="with no LLM server healthy (an outage: servers restarting, reloading weights), how long a turn waits "
        "for one before its episode fails, as the outage's (default %(default)s; the job's time budget bounds it too)",
    )
    serve.add_argument(
        "--llm-call-timeout-s",
        type=_positive_float,
        default=RolloutConfig.llm_call_timeout_s,
        metavar="S",
        help="each generation request's own limit, past which its server counts as stalled and the turn fails over "
        "(default: none; the job's time budget, --timeout or its timeout_s, bounds every call)",
    )
    serve.add_argument(
        "--tokenizer",
        required=True,
        help=f"the policy's tokenizer: a directory (the local tiny vLLM's: {TINY_TOKENIZER}) or a Hugging Face Hub "
        "name, which must be in the local cache or downloadable now",
    )
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
    pipeline = PipelineConfig()  # the defaults below are the configuration dataclasses' own, written there once
    serve.add_argument(
        "--timeout",
        type=_positive_float,
        default=pipeline.default_timeout_s,
        help="default time budget of a job, in seconds",
    )
    serve.add_argument("--max-init-workers", type=_at_least(1), default=pipeline.max_init_workers)
    serve.add_argument(
        "--max-run-workers",
        type=int,
        default=pipeline.max_run_workers,
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
    serve.add_argument("--max-eval-workers", type=_at_least(1), default=pipeline.max_eval_workers)
    serve.add_argument(
        "--init-ahead",
        type=_at_least(0),
        default=pipeline.init_ahead,
        metavar="N",
        help="back-pressure: init makes a sandbox only while the episodes in the run stage and the jobs made ready "
        "for it are fewer than the run stage's limit plus N (default: a quarter of the limit, at least 1)",
    )
    serve.add_argument("--plugin", action="append", default=[], help="import path of a plugin (repeatable)")
    serve.add_argument("--block-plugin", action="append", default=[], help="name of a plugin not to load")
    serve.add_argument(
        "--buffer",
        default=os.environ.get("PRORL_BUFFER_URL", RolloutConfig.buffer_url),
        help="the service's state (experience buffer, upcoming prompts, jobs, runtimes, policy version): "
        "memory:// or redis://host:port/db (survives a restart; replicas given the same URL share the work); "
        "env PRORL_BUFFER_URL (keeps a Redis password off the command line)",
    )
    producer = ProducerConfig()
    serve.add_argument(
        "--lease-s",
        type=float,
        default=producer.lease_s,
        help="how long a taken batch may stay unacknowledged before its entries are delivered again "
        "(default %(default)s; POST /v1/batches may ask otherwise)",
    )
    serve.add_argument(
        "--max-deliveries",
        type=int,
        default=producer.max_deliveries,
        help="deliveries after which an unacknowledged entry is a dead letter (default %(default)s)",
    )
    serve.add_argument(
        "--max-buffered",
        type=int,
        default=producer.max_buffered,
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
        default=RolloutConfig.result_ttl_s,
        help="with a Redis --buffer: how long a finished job's result stays readable (default %(default)s)",
    )
    serve.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep every finished trajectory, failures included, as Parquet shards under DIR (docs/records.md)",
    )
    serve.add_argument(
        "--gateway-host", default=None, help="where the LLM gateway for agent programs listens (default: --host)"
    )
    serve.add_argument(
        "--gateway-port", type=int, default=RolloutConfig.gateway_port, help="its port (default: a free one)"
    )
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
        default=RolloutConfig.max_concurrent_creates,
        help="sandbox creations in flight on one runtime from this replica at most, episodes' before warm "
        "refills (default %(default)s: no limit)",
    )
    serve.add_argument(
        "--wait-for-runtime-s",
        type=_positive_float,
        default=RolloutConfig.wait_for_runtime_s,
        metavar="S",
        help="how long an init waits for a sandbox runtime while none is alive (one registering, say) before its "
        "attempt fails (default %(default)s)",
    )
    breaker = BreakerConfig()
    serve.add_argument(
        "--breaker-threshold",
        type=float,
        default=breaker.threshold,
        metavar="SHARE",
        help="the circuit breaker: pause admission once this share of one policy version's episodes (with at least "
        "--breaker-min-episodes of them) shows a signal; POST /v1/breaker/reset resumes it (default: off)",
    )
    serve.add_argument(
        "--breaker-min-episodes",
        type=_at_least(1),
        default=breaker.min_episodes,
        metavar="N",
        help="episodes of one version counted before the breaker weighs its share (default %(default)s)",
    )
    serve.add_argument(
        "--breaker-signals",
        default=",".join(breaker.signals),
        metavar="LIST",
        help="the signals the breaker weighs, comma-separated: some of %(default)s (default: all)",
    )
    serve.add_argument("--log-level", type=log_level, default="INFO", help=f"one of {', '.join(LOG_LEVELS)}")
    serve.add_argument(
        "--debug",
        action="store_true",
        help="log at DEBUG, and show the traceback of a failure to start (otherwise one line)",
    )
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
    add_records_parsers(sub)
    add_view_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "export":
        return run_export(args)
    if args.command == "import":
        return run_import(args)
    if args.command == "ray":
        return run_ray(args)
    if args.command == "view":
        return run_view(args)
    if args.command == "plugins":
        return list_plugins(args.plugin, args.block_plugin, args.plugin_config)
    if args.command == "openapi":
        from server_kit.openapi import openapi_command

        from .gateway import GATEWAY_API
        from .server import ROLLOUT_API

        if args.out is None:
            return openapi_command(GATEWAY_API if args.gateway else ROLLOUT_API, None)
        return openapi_command(ROLLOUT_API, args.out) or openapi_command(GATEWAY_API, args.out)
    debug = args.debug or args.log_level == "DEBUG"
    level = "DEBUG" if args.debug else args.log_level
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server_kit.webapp import listen_address

    try:
        listen_socket, host, port = listen_address(args.listen_fd, args.host, args.port, RolloutConfig.port)
        if not 0 <= port <= 65535:
            raise ValueError(f"--port {port} is not a port: give one in 1-65535 (0: a free one)")
    except ValueError as exc:
        return fail(PROG, str(exc))
    config = RolloutConfig(
        sandbox_urls=args.sandbox_url,
        llm_urls=args.llm_url,
        llm_stream=args.llm_stream,
        llm_outage_wait_s=args.llm_outage_wait_s,
        llm_call_timeout_s=args.llm_call_timeout_s,
        tokenizer=tokenizer_argument(args.tokenizer),
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
            init_ahead=args.init_ahead,
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
        record_dir=args.record,
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
        wait_for_runtime_s=args.wait_for_runtime_s,
        breaker=BreakerConfig(
            threshold=args.breaker_threshold,
            min_episodes=args.breaker_min_episodes,
            signals=tuple(name.strip() for name in args.breaker_signals.split(",") if name.strip()),
        ),
    )
    problem = buffer_url_problem(config.buffer_url)
    if problem is not None:
        return fail(PROG, problem)
    try:
        config.plugin_config = read_plugin_config(args.plugin_config)
        config.check()
        config.connections = config.connections.resolve(sites=2)  # the API and the gateway
    except ValueError as exc:
        return fail(PROG, str(exc))
    from server_kit.webapp import run_forever

    readiness = Readiness()
    try:
        run_forever(serve_checked(config, readiness))
    except Exception as exc:
        return stopped_by(PROG, exc, readiness, debug, failure_line(exc, readiness.ready))
    return 0


async def serve_checked(config: RolloutConfig, ready: Readiness) -> None:
    """`serve`, after the checks that fail fast and say what to change: the tokenizer can be loaded (without 25 s
    of download retries first), a Redis --buffer answers, the API's port is free (bound here, before the minute
    start-up may take) and so is the gateway's address."""
    from server_kit.webapp import bound_socket

    from .server import serve

    problem = tokenizer_problem(config.tokenizer)
    if problem is None and config.buffer_url.startswith(REDIS_SCHEMES):
        problem = await redis_problem(config.buffer_url)
    if problem is not None:
        raise StartupError(problem)
    if config.listen_socket is None:
        try:
            config.listen_socket = bound_socket(config.host, config.port)
        except OSError as exc:
            raise StartupError(listen_problem(exc, config.host, config.port, "--host", "--port")) from exc
    try:  # bound and closed: `serve` binds it again, once the API's socket holds its own port
        bound_socket(config.gateway_host, config.gateway_port).close()
    except OSError as exc:
        where = listen_problem(exc, config.gateway_host, config.gateway_port, "--gateway-host", "--gateway-port")
        raise StartupError(f"the LLM gateway {where}") from exc
    await serve(config, ready)


def listen_problem(exc: OSError, host: str, port: int, host_flag: str, port_flag: str) -> str:
    """Why a socket cannot listen on host:port, in one line naming the flag that fixes it."""
    if isinstance(exc.errno, int) and exc.errno > 0:
        reason = os.strerror(exc.errno)
    else:  # a name that does not resolve: create_server's message repeats the address
        reason = (exc.strerror or str(exc)).partition(" (while")[0]
    if exc.errno == errno.EADDRINUSE:
        fix = f"give {port_flag} a free port, or stop what holds this one"
    elif exc.errno == errno.EACCES:
        fix = f"give {port_flag} a port above 1023"
    else:  # a name that does not resolve, an address of another machine
        fix = f"give {host_flag} a name or address of this machine"
    return f"cannot listen on {host}:{port} ({reason}): {fix}"


BUFFER_FLAG = "--buffer (or PRORL_BUFFER_URL)"


def buffer_url_problem(url: str) -> str | None:
    """What is wrong with a --buffer URL, without showing its password, else None: no known scheme, a port or a
    database that is no number (redis-py would take `/x` for database 0)."""
    if url == "memory://":
        return None
    if not url.startswith(REDIS_SCHEMES):
        return (
            f"{BUFFER_FLAG} names no buffer ({buffer_scheme(url)}): give memory:// or redis://[:PASSWORD@]HOST:PORT/DB "
            "(also rediss://, unix://PATH)"
        )
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError as exc:  # its message quotes the port, nothing else of the URL
        return f"{BUFFER_FLAG}: {exc}; give redis://[:PASSWORD@]HOST:PORT/DB"
    if url.startswith("unix://"):
        return None if parts.path else f"{BUFFER_FLAG}: unix:// names no socket; give unix://PATH"
    database = parts.path.strip("/")
    if database and not database.isdigit():
        # Not shown: a URL mistyped (`redis:///:secret@host`) may have its password there.
        return f"{BUFFER_FLAG}: what follows HOST:PORT is no database number; give redis://HOST:PORT/DB, e.g. /0"
    return None


async def redis_problem(url: str) -> str | None:
    """Why the Redis of a --buffer URL cannot be used now, found with one PING (5 s at most), else None. A running
    service rides out a Redis outage; one that starts on a Redis it cannot reach (a wrong host, port or password)
    would retry for ever before it listens, saying only that Redis is away."""
    try:
        from redis import exceptions as redis_errors
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
    except ImportError:
        return f"{BUFFER_FLAG} names Redis, and the redis package is not installed: pip install 'prorl-adapter[redis]'"
    from .storage.redis_connection import redact

    where = f"{BUFFER_FLAG}: Redis at {redact(url)}"
    client = Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0, retry=Retry(NoBackoff(), 0))
    try:
        await client.ping()
    except redis_errors.BusyLoadingError:
        return None  # up, and loading its data: the service's own calls wait for that
    except redis_errors.AuthenticationError as exc:
        return f"{where} refused the credentials ({exc}): fix the password in the URL"
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        return f"{where} cannot be reached ({' '.join(str(exc).split())}): start it, or fix the URL's host and port"
    except redis_errors.ResponseError as exc:  # a database it does not have, a user without PING
        return f"{where} refused the connection ({exc}): fix the URL's database, user or password"
    finally:
        await client.aclose()
    return None


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:(?=//)")


def buffer_scheme(url: str) -> str:
    """The scheme of a buffer URL, and nothing else of it, for a message: the rest may hold a password, and a URL
    mistyped without its colon (`redis//:secret@host`) has no scheme, so no part of it is shown."""
    found = _SCHEME.match(url)
    return f"scheme {found.group(0)}" if found else "no scheme: a URL starts SCHEME://"


def failure_line(exc: BaseException, ready: bool = False) -> str:
    """One line for a failure that ended the service: what failed and, where known, what to change. After
    start-up (`ready`), its traceback precedes it in the log."""
    if isinstance(exc, StartupError):
        return str(exc)
    said = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    if ready:
        return f"stopped by {said} (the traceback is above)"
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return f"an address is in use ({os.strerror(exc.errno)}): give --gateway-port (or --port) a free port"
    # What the operator chose, found as the service starts: the message names it, and here the flag that gives it.
    message = " ".join(str(exc).split())
    if isinstance(exc, TokenizerError):
        return f"{message}; give --tokenizer the policy's tokenizer, with its chat template"
    if isinstance(exc, PluginConfigError):
        return f"{message}; fix --plugin-config (`prorl-rollout plugins --plugin-config FILE` checks it)"
    if isinstance(exc, PluginLoadError):
        return f"{message}; fix --plugin or --block-plugin (`prorl-rollout plugins` lists what loads)"
    return f"failed to start: {said} (--debug shows the traceback)"


def tokenizer_argument(name: str) -> str:
    """What the tokenizer loader is given for `--tokenizer name`: a directory with `~` expanded (transformers
    would take `~/tok` for a Hub name), else the name as given."""
    path = Path(name).expanduser()
    return str(path) if os.path.isdir(path) else name  # one this user cannot reach: `tokenizer_problem` says so


def looks_local(name: str) -> bool:
    """Whether `--tokenizer name` is meant as a directory, not a Hub name: it is written as a path (`./`, `../`,
    `/`, `~`, a trailing `/`, more than one `/`), it is the tiny model's path (which exists only in the clone, after
    `make llm`), or its first component is a directory here (`models/` of `models/tiny-qwen2`)."""
    if name.startswith(("./", "../", "/", "~")) or name in (".", "..") or name.endswith("/") or name.count("/") > 1:
        return True
    if Path(name) == Path(TINY_TOKENIZER):
        return True
    parts = Path(name).parts
    return len(parts) > 1 and Path(parts[0]).is_dir()


def tokenizer_problem(name: str) -> str | None:
    """Why `--tokenizer name` cannot be loaded, found in well under a second, else None. A directory must hold a
    tokenizer; a Hugging Face Hub name must be in the local cache or, unless HF_HUB_OFFLINE is set, known to a Hub
    that answers now (one request, 5 s at most: transformers' own attempt retries for 25 s when it cannot
    connect, then prints a 137-line traceback)."""
    fix = "give --tokenizer a tokenizer's directory (the local tiny vLLM's: "
    fix += f"--tokenizer {TINY_TOKENIZER}, which `make llm` builds)"
    files = " or ".join("+".join(group) for group in TOKENIZER_FILES)
    path = Path(name).expanduser()
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        pass  # no such path: a directory missing, or a Hub name
    except OSError as exc:  # a directory on the way this user may not enter
        return f"--tokenizer {name}: this user cannot reach it ({exc.strerror}); {fix}"
    if path.is_dir():
        if not os.access(path, os.R_OK | os.X_OK):
            return f"--tokenizer {name}: this user cannot read the directory; {fix}"
        if not any(all((path / f).is_file() for f in group) for group in TOKENIZER_FILES):
            return f"--tokenizer {name}: the directory holds no tokenizer (no {files}); {fix}"
        return None
    if path.exists():
        return f"--tokenizer {name} is a file; {fix}"
    if looks_local(name):
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        if Path(name) == Path(TINY_TOKENIZER):
            return f"--tokenizer {name}: no such directory{where}; run from the clone's root after `make llm`"
        return f"--tokenizer {name}: no such directory{where}; {fix}"
    from huggingface_hub import constants, get_token, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    fix += f" or a Hub name downloaded first (`hf download {name}`)"
    try:
        cached = [all(isinstance(try_to_load_from_cache(name, f), str) for f in g) for g in TOKENIZER_FILES]
        if any(cached):
            return None
    except HFValidationError:
        return f"--tokenizer {name}: neither a directory nor a Hub name; {fix}"
    where = f"neither a directory nor in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return f"--tokenizer {name}: {where}, and HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set; {fix}"
    token = get_token()  # a private or gated model is known to the Hub only to a token that may read it
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{constants.ENDPOINT}/api/models/{name}", headers=headers, method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=5.0).close()
    except urllib.error.HTTPError as exc:
        private = "" if token else " (a private or gated one needs `hf auth login` or HF_TOKEN)"
        return f"--tokenizer {name}: {where}, and {constants.ENDPOINT} has no such model{private} ({exc.code}); {fix}"
    except (OSError, ValueError) as exc:  # URLError, a timeout, a malformed HF_ENDPOINT
        reason = getattr(exc, "reason", None) or exc
        return f"--tokenizer {name}: {where}, and {constants.ENDPOINT} cannot be reached ({reason}); {fix}"
    return None  # on the Hub: transformers downloads it


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
