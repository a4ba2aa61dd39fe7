"""Pre-flight: compose verl's config with your overrides and check the plugin lines, before any GPU work.

    python -m prorl_plugins.verl.check <the same overrides you pass to verl.trainer.main_ppo> [--no-network]

It composes verl's own `ppo_trainer` config with hydra (an override naming a key verl does not have fails
here, as it would in verl), validates the `prorl` block and the lines around it, and, unless told not to,
asks the rollout service (and the sandbox runtime, if `prorl.sandbox_url` is set) whether they answer.
"""

from __future__ import annotations

import os
import sys

import httpx
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig

from .config import BLOCK, ProrlVerlConfigError, check_verl_config


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    network = "--no-network" not in argv
    overrides = [a for a in argv if a != "--no-network"]
    try:
        prorl = check_verl_config(compose_verl_config(overrides))
        if network:
            ping(prorl.service_url, "/healthz", "rollout service", f"{BLOCK}.service_url")
            if prorl.sandbox_url:
                ping(prorl.sandbox_url, "/healthz", "sandbox runtime", f"{BLOCK}.sandbox_url")
    except (ProrlVerlConfigError, HydraException) as exc:
        print(f"prorl verl plugin: {exc}", file=sys.stderr)
        return 2
    print(
        f"prorl verl plugin: OK (service {prorl.service_url}, task {prorl.task}, "
        f"staleness {prorl.staleness_config.mode}, reward from the {prorl.reward_source})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
