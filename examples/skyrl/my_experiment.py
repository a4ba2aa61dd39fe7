"""The same hook from your own SkyRL entry point: `get_generator` is the one method to override.

python examples/skyrl/my_experiment.py prorl.rollout_url=http://rollout:8766 ...  (the keys in this folder's README.md)
"""

from __future__ import annotations

import sys

import prorl_plugins.skyrl.compat  # noqa: F401  (SkyRL on Python 3.11: before any skyrl import)

# isort: split
import ray
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.utils import initialize_ray

from prorl_plugins.skyrl.config import ProRLSkyRLConfig, check
from prorl_plugins.skyrl.generator import ProRLGenerator


class MyExperiment(BasePPOExp):
    def get_generator(self, cfg, tokenizer, inference_engine_client):
        return ProRLGenerator.from_config(cfg, tokenizer)  # <- the line


@ray.remote(num_cpus=1)
def run(cfg):
    MyExperiment(cfg).run()


if __name__ == "__main__":
    cfg = ProRLSkyRLConfig.from_cli_overrides(sys.argv[1:])  # SkyRL's config plus the `prorl` section
    check(cfg)
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(run.remote(cfg))
