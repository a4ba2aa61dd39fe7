"""`ProRLGenerator`: the SkyRL generator whose episodes run on the rollout service.

SkyRL's trainer calls `generate(GeneratorInput)` once per step; the generator hands it to the driver
(`RolloutDriver.generate`), which calls the backend hooks of `SkyRLBackend` (the trainer's step as the policy
version, rows as jobs, trajectories as SkyRL's `GeneratorOutput`), runs the jobs on the service and weighs the
trajectories with the shared plugins of this process (staleness, from the same configuration the service reads;
reward shaping already ran on the service).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput

from prorl_adapter.hooks import PluginSet
from prorl_adapter.trainer import RolloutClient, RolloutDriver

from . import compat  # noqa: F401  (before the first skyrl import)
from .hooks import SkyRLBackend


class ProRLGenerator(GeneratorInterface):
    def __init__(
        self,
        rollout_url: str,
        plugin_config: Mapping[str, Any] | None = None,
        backend: SkyRLBackend | None = None,
        plugins: Iterable[str] = (),
        request_config: Mapping[str, Any] | None = None,
        token: str | None = None,
        wait_s: float = 3600.0,
    ) -> None:
        """`plugin_config`: the service's plugin configuration; `plugins`: extra plugin import paths;
        `request_config`: `max_turns`, `max_context_tokens`, `timeout_s` for every job."""
        self.rollout_url = rollout_url
        self.token = token
        self.wait_s = wait_s
        self.request_config = dict(request_config or {})
        self.backend = backend or SkyRLBackend()
        self.plugins = PluginSet.load(plugin_config, import_paths=plugins, objects=[self.backend])
        self._published: int | None = None  # the last version published, kept across the per-call drivers

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any = None) -> ProRLGenerator:
        """From SkyRL's config (`ProRLSkyRLConfig`); what `BasePPOExp.get_generator` returns."""
        from .config import check, plugin_config

        prorl = check(cfg)
        filler = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        return cls(
            prorl.rollout_url,
            plugin_config(prorl),
            backend=SkyRLBackend(filler_token_id=filler, step_wise=cfg.generator.step_wise_trajectories),
            plugins=prorl.plugins,
            request_config={
                "max_turns": cfg.generator.max_turns,
                "max_context_tokens": cfg.generator.max_input_length,
                "timeout_s": prorl.timeout_s,
            },
            token=prorl.token,
            wait_s=prorl.wait_s,
        )

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        # One client per call: SkyRL may call from a different event loop each time.
        async with RolloutClient(self.rollout_url, token=self.token) as client:
            driver = RolloutDriver(client, self.plugins, self.request_config, wait_s=self.wait_s)
            driver.published = self._published
            try:
                return await driver.generate(input_batch)
            finally:
                self._published = driver.published
