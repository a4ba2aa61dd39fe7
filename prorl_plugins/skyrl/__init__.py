"""SkyRL as a training backend: a SkyRL `GeneratorInterface` on top of the rollout service.

- `hooks.SkyRLBackend`: the backend hook implementation (`prorl_backend_requests`, `prorl_backend_batch`,
  `prorl_backend_policy_version`): SkyRL's `GeneratorInput` in, SkyRL's `GeneratorOutput` out.
- `generator.ProRLGenerator`: the generator SkyRL's trainer calls; it hands each request to the driver
  (`prorl_adapter.trainer.RolloutDriver`), which runs the episodes on the rollout service and weighs them with
  the shared plugins.
- `config`: the `prorl` section SkyRL's config gains; `entrypoint`: `BasePPOExp.get_generator` overridden, and
  the `main` that `trainer.override_entrypoint=prorl_plugins.skyrl.entrypoint` runs.

Importing this package does not import SkyRL; each module above does (through `compat`). docs/backends.md.
"""
