"""Pre-flight: compose verl's config with your overrides and check the plugin lines, before any GPU work.

    python -m prorl_plugins.verl.check <the same overrides you pass to verl.trainer.main_ppo> [--no-network]
    python -m prorl_plugins.verl.check --help

It composes verl's own `ppo_trainer` config with hydra (an override naming a key verl does not have fails
here, as it would in verl) and checks the `prorl` block and the verl lines around it (`config.LINES`). Then,
unless told not to, it asks the rollout service whether it answers, whether it has `prorl.task`
(`GET /v1/tasks`) and whether the plugin sections it was started with agree with the block
(`GET /v1/plugins`), and the sandbox runtime, if `prorl.sandbox_url` is set, whether it answers; with
`prorl.launch=ray` there is no service to ask yet (the run starts it). Anything wrong exits with status 2 and a
message naming the line to write: every wrong line at once, the service's answers (a task it does not have)
beside the verl lines. An override hydra cannot read is one line naming it.
"""

from __future__ import annotations

import os
import sys

import httpx
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig
from pydantic import ValidationError

from prorl_adapter.trainer.client import RolloutAPIError, SyncRolloutClient

from .config import BLOCK, ProrlVerlConfig, ProrlVerlConfigError, _select, check_service, check_verl_config

NO_NETWORK = "--no-network"
HELP = ("-h", "--help")
PREFIX = "prorl verl plugin"


def verl_config_dir() -> str:
    import verl.trainer

    return os.path.join(os.path.dirname(verl.trainer.__file__), "config")


def compose_verl_config(overrides: list[str], config_name: str = "ppo_trainer") -> DictConfig:
    """verl's trainer config with `overrides`, composed the way `python -m verl.trainer.main_ppo` does."""
    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def ping(url: str, path: str, what: str, key: str) -> None:
    try:
        httpx.get(url + path, timeout=5.0).raise_for_status()
    except httpx.HTTPError as exc:
        raise ProrlVerlConfigError(f"the {what} at {url} ({key}) does not answer {path}: {exc}") from exc


def check_against_service(prorl: ProrlVerlConfig) -> list[str]:
    """What the service says is wrong: it does not answer; or the task is not one of its tasks, and the plugin
    sections it was started with disagree with the block (both told, not only the first)."""
    try:
        ping(prorl.service_url, "/healthz", "rollout service", f"{BLOCK}.service_url")
    except ProrlVerlConfigError as exc:
        return [str(exc)]
    with SyncRolloutClient(prorl.service_url, token=prorl.token, timeout=10.0) as client:
        try:
            tasks, plugins = client.tasks(), client.plugins()
        except (RolloutAPIError, httpx.HTTPError, ValidationError) as exc:  # ValidationError: not this API version
            return [
                f"the rollout service at {prorl.service_url} does not tell its tasks and plugin sections "
                f"(GET /v1/tasks, /v1/plugins): {exc}"
            ]
    return _problems(lambda: check_service(prorl, tasks, None), lambda: check_service(prorl, None, plugins.config))


def _problems(*checks) -> list[str]:
    """The messages of the checks that raised ProrlVerlConfigError, each check run."""
    found = []
    for check in checks:
        try:
            check()
        except ProrlVerlConfigError as exc:
            found.append(str(exc))
    return found


def verl_problems(config: DictConfig) -> tuple[ProrlVerlConfig | None, list[str]]:
    """The block (None where it is wrong itself) and every wrong line of it and of the verl lines around it."""
    try:
        return check_verl_config(config), []
    except ProrlVerlConfigError as exc:
        lines = str(exc).splitlines()
        if len(lines) > 1 and lines[0].endswith("verl lines are wrong:"):  # one complaint per indented line
            lines = lines[1:]
        wrong = [line.strip() for line in lines]
    try:
        return ProrlVerlConfig.from_block(_select(config, BLOCK)), wrong  # the block is fine: the service can be asked
    except ProrlVerlConfigError:
        return None, wrong


def override_problem(overrides: list[str], exc: HydraException) -> str:
    """Hydra's complaint in one line, naming the override: its own messages span lines, with a caret and a link."""
    message = " ".join(
        line.strip()
        for line in str(exc).splitlines()
        if line.strip() and line.strip() != "^" and "hydra.cc" not in line
    )
    if isinstance(exc, OverrideParseException):
        parser = OverridesParser.create()
        for override in overrides:
            try:
                parser.parse_overrides([override])
            except OverrideParseException:
                if override.startswith("-"):
                    return (
                        f"unknown option {override}: the options are {NO_NETWORK} and --help; everything else is a "
                        "verl override such as key=value"
                    )
                return f"override {override!r} cannot be read ({message}); write key=value, +key=value or ~key"
    return message


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in HELP for arg in argv):
        print(__doc__.strip())
        return 0
    network = NO_NETWORK not in argv
    overrides = [a for a in argv if a != NO_NETWORK]
    try:
        config = compose_verl_config(overrides)
    except HydraException as exc:
        print(f"{PREFIX}: {override_problem(overrides, exc)}", file=sys.stderr)
        return 2
    prorl, problems = verl_problems(config)
    asked = prorl is not None and network and prorl.launch is None  # a launched stack starts with the run
    if asked:
        problems += check_against_service(prorl)
        if prorl.sandbox_url:
            problems += _problems(
                lambda: ping(prorl.sandbox_url, "/healthz", "sandbox runtime", f"{BLOCK}.sandbox_url")
            )
    if len(problems) == 1:
        print(f"{PREFIX}: {problems[0]}", file=sys.stderr)
    elif problems:
        print(f"{PREFIX}: {len(problems)} lines are wrong:\n  " + "\n  ".join(problems), file=sys.stderr)
    if problems:
        return 2
    if prorl.launch is not None:
        checked = f"the stack starts on verl's Ray cluster with the run ({BLOCK}.launch={prorl.launch}): not asked"
    elif network:
        checked = f"the service has task {prorl.task} and its plugin sections agree"
    else:
        checked = f"{NO_NETWORK}: the service, its tasks (is {prorl.task} one?) and its plugin sections not checked"
    service = prorl.service_url or f"launched on Ray, {prorl.launch_replicas} replica(s)"
    print(
        f"{PREFIX}: OK (service {service}, task {prorl.task}, "
        f"staleness {prorl.staleness_config.mode}, reward from the {prorl.reward_source}; {checked})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
