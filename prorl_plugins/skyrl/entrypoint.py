"""SkyRL's entry point with the rollout service as its generator.

Run SkyRL as usual, plus one line (SkyRL's `main_base` hands the command line to this module's `main`):

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=prorl_plugins.skyrl.entrypoint \\
        prorl.rollout_url=http://rollout:8766 prorl.plugin_config_file=plugins.json ...

or subclass `ProRLPPOExp` in your own entry point. Importing this module imports SkyRL's trainer (and sets
multiprocessing's start method to spawn, as SkyRL's `main_base` does on import).
"""

from __future__ import annotations

import sys

import ray
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.utils import initialize_ray

from . import compat  # noqa: F401  (before the first skyrl import)
from .config import ProRLSkyRLConfig, check
from .generator import ProRLGenerator

OVERRIDE_ARG = "trainer.override_entrypoint="


class ProRLPPOExp(BasePPOExp):
    """SkyRL's PPO experiment whose generator is the rollout service (the one overridden method)."""

    def get_generator(self, cfg, tokenizer, inference_engine_client):
        return ProRLGenerator.from_config(cfg, tokenizer)


def parse_config(argv: list[str]) -> ProRLSkyRLConfig:
    """SkyRL's command line (`key.path=value` overrides) with the `prorl` section, checked."""
    cfg = ProRLSkyRLConfig.from_cli_overrides([arg for arg in argv if not arg.startswith(OVERRIDE_ARG)])
    check(cfg)
    return cfg


@ray.remote(num_cpus=1)
def prorl_skyrl_entrypoint(cfg: ProRLSkyRLConfig) -> None:
    ProRLPPOExp(cfg).run()  # not on the head node, as SkyRL's own entry point


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(prorl_skyrl_entrypoint.remote(cfg))


if __name__ == "__main__":
    main()
