"""The trainer's side: the rollout client, and the driver every training backend goes through
(`RolloutDriver`: trainer request -> backend hooks -> jobs -> weights -> the trainer's batch)."""

from .client import RolloutAPIError, RolloutClient
from .driver import RolloutDriver

__all__ = ["RolloutAPIError", "RolloutClient", "RolloutDriver"]
