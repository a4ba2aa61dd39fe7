"""`ProRLGenerator`: the SkyRL generator whose episodes run on the rollout service.

Each `generate(GeneratorInput)` call is one coupled round: the trainer's global step is published to the
service as the policy version, every row becomes one job (`SkyRLBackend.prorl_backend_requests`), the jobs run
to completion (`RolloutClient.run_many`), the trajectories are weighed by the shared plugins in this process
(`TrainerPlugins.samples`: staleness, from the same configuration the service reads; reward shaping already
ran on the service), and the answer is SkyRL's `GeneratorOutput` (`SkyRLBackend.prorl_backend_batch`). All of
it goes through the hooks, so a plugin registered beside `SkyRLBackend` can take any step over.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput

from prorl_adapter.trainer.client import RolloutClient
from prorl_adapter.trainer.samples import TrainerPlugins, TrainingSample

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
        self.backend = backend or SkyRLBackend()
        self.request_config = dict(request_config or {})
        self.plugins = TrainerPlugins(plugin_config, import_paths=plugins, objects=[self.backend])
        self._published: int | None = None  # the last version this generator published to the service

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any = None) -> ProRLGenerator:
        """From SkyRL's config (`ProRLSkyRLConfig`); what `BasePPOExp.get_generator` returns."""
        from .config import check, plugin_config

        prorl = check(cfg)
        filler = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        return cls(
            prorl.rollout_url,
            plugin_config(prorl),
            backend=SkyRLBackend(filler_token_id=filler),
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
        samples = await self.samples(input_batch)
        output = self.plugins.hooks.prorl_backend_batch(
            trajectories=[s.trajectory for s in samples], weights=[s.weight for s in samples], batch=input_batch
        )
        if output is None:
            raise TypeError("no backend plugin turned the trajectories into a SkyRL GeneratorOutput")
        return output

    async def samples(self, input_batch: GeneratorInput) -> list[TrainingSample]:
        """The batch's episodes, run on the service and weighed at the trainer's version, in row order."""
        hooks = self.plugins.hooks
        requests = hooks.prorl_backend_requests(batch=input_batch, config=self.request_config)
        if requests is None:
            raise TypeError("no backend plugin turned the SkyRL GeneratorInput into rollout jobs")
        version = hooks.prorl_backend_policy_version()
        async with RolloutClient(self.rollout_url, token=self.token) as client:
            if version is not None and version != self._published:
                await client.set_policy_version(version)
                self._published = version
                hooks.prorl_policy_version_changed(version=version)
            trajectories = await client.run_many(requests, wait=self.wait_s)
        if version is None:  # no batch_metadata: weigh against the newest version the batch was produced at
            version = max(t.policy_version_max for t in trajectories)
        return self.plugins.samples(trajectories, version)
