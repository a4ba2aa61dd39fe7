"""Pre-flight: compose verl's config with your overrides and check the plugin lines, before any GPU work.

    python -m prorl_plugins.verl.check <the same overrides you pass to verl.trainer.main_ppo> [--no-network]

It composes verl's own `ppo_trainer` config with hydra (an override naming a key verl does not have fails
here, as it would in verl) and checks the `prorl` block and the verl lines around it (`config.LINES`). Then,
unless told not to, it asks the rollout service whether it answers, whether it has `prorl.task`
(`GET /v1/tasks`) and whether the plugin sections it was started with agree with the block
(`GET /v1/plugins`), and the sandbox runtime, if `prorl.sandbox_url` is set, whether it answers; with
`prorl.launch=ray` there is no service to ask yet (the run starts it). Anything wrong exits with status 2 and a
message naming the line to write.
"""

from __future__ import annotations

import os
import sys

import httpx
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig
from pydantic import ValidationError

from prorl_adapter.trainer.client import RolloutAPIError, SyncRolloutClient

from .config import BLOCK, ProrlVerlConfig, ProrlVerlConfigError, check_service, check_verl_config

NO_NETWORK = "--no-network"


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


def check_against_service(prorl: ProrlVerlConfig) -> None:
    """The service answers, has the task, and was started with plugin sections that agree with the block."""
    ping(prorl.service_url, "/healthz", "rollout service", f"{BLOCK}.service_url")
    with SyncRolloutClient(prorl.service_url, token=prorl.token, timeout=10.0) as client:
        try:
            tasks, plugins = client.tasks(), client.plugins()
        except (RolloutAPIError, httpx.HTTPError, ValidationError) as exc:  # ValidationError: not this API version
            raise ProrlVerlConfigError(
                f"the rollout service at {prorl.service_url} does not tell its tasks and plugin sections "
                f"(GET /v1/tasks, /v1/plugins): {exc}"
            ) from exc
    check_service(prorl, tasks, plugins.config)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    network = NO_NETWORK not in argv
    overrides = [a for a in argv if a != NO_NETWORK]
    try:
        prorl = check_verl_config(compose_verl_config(overrides))
        if network and prorl.launch is None:  # a launched stack starts with the run: nothing to ask yet
            check_against_service(prorl)
            if prorl.sandbox_url:
                ping(prorl.sandbox_url, "/healthz", "sandbox runtime", f"{BLOCK}.sandbox_url")
    except (ProrlVerlConfigError, HydraException) as exc:
        print(f"prorl verl plugin: {exc}", file=sys.stderr)
        return 2
    if prorl.launch is not None:
        checked = f"the stack starts on verl's Ray cluster with the run ({BLOCK}.launch={prorl.launch}): not asked"
    elif network:
        checked = f"the service has task {prorl.task} and its plugin sections agree"
    else:
        checked = f"{NO_NETWORK}: the service, its tasks (is {prorl.task} one?) and its plugin sections not checked"
    service = prorl.service_url or f"launched on Ray, {prorl.launch_replicas} replica(s)"
    print(
        f"prorl verl plugin: OK (service {service}, task {prorl.task}, "
        f"staleness {prorl.staleness_config.mode}, reward from the {prorl.reward_source}; {checked})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
