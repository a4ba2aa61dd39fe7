"""The verl hook implementation: verl's PPO/GRPO loop with its episodes run by the rollout service.

Importing this package registers the `prorl_agent` agent loop with verl's registry. verl imports it through
`actor_rollout_ref.model.external_lib=prorl_plugins.verl` (in every agent loop worker; an import error stops
the run with its message) and through the `verl.plugins` entry point (whose errors verl only logs at debug
level, hence the explicit line). docs/verl.md has the lines a user adds.

Modules, one job each: `config` (the `prorl` block, the table of the verl lines a recipe needs, and the checks
derived from it), `agent_loop` (asks the rollout driver for its one sample), `backend` (the backend hooks: a
verl sample as a job, its trajectory as verl's output), `sampler` (staleness on verl's V1 replay buffer),
`reward` (verl's custom_reward_function), `check` (the pre-flight command).
"""

from .agent_loop import ProrlAgentLoop
from .config import AGENT_LOOP_NAME, ProrlVerlConfig, ProrlVerlConfigError, check_verl_config

__all__ = ["AGENT_LOOP_NAME", "ProrlAgentLoop", "ProrlVerlConfig", "ProrlVerlConfigError", "check_verl_config"]
