"""What the CPU trainer trains on: a model, a task's rows, and how each episode is asked for.

- `relay` (the default, `make demo`): the tiny random model (models/tiny-qwen2) on the `relay` task, each turn
  forced by a regex into one of a few tool calls, so the trainer rebuilds vLLM's grammar mask
  (`FiniteActionMask`) to score the policy that really sampled.
- `arithmetic` (`make demo-real`): the real pretrained SmolLM2-135M-Instruct (localstack.REAL_MODEL) on
  generated arithmetic questions (the `arithmetic` task), actions written as fenced text blocks, no grammar and
  so no mask: the policy is softmax(logits / T), what vLLM samples at the workload's temperature (0.7) and
  reports, each turn ending at its first block's closing fence.

A workload also carries the settings it trains well with (`settings`): the real model's turns are long and
its steps slow on CPU, so it takes fewer, smaller steps than the tiny one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Protocol

from prorl_adapter.dev import localstack
from prorl_plugins.tasks.arithmetic import ArithmeticLevel, ArithmeticTask, arithmetic_instances
from prorl_plugins.tasks.relay import TURNS, RelayTask, relay_instances, relay_regex, relay_turn_texts

from .constrained import FiniteActionMask


class TrainSettings(Protocol):
    """What a workload reads of the trainer's settings (train.TrainSettings)."""

    seed: int
    max_tokens_per_turn: int
    temperature: float
    tool_latency_median_s: float

    def arithmetic_level(self) -> ArithmeticLevel: ...


class Workload(ABC):
    name: ClassVar[str]
    task: ClassVar[str]
    action_format: ClassVar[str | None] = None  # None: the task's own
    max_turns: ClassVar[int]
    max_context_tokens: ClassVar[int] = 4096
    # TrainSettings fields that differ from the dataclass's defaults for this workload (`settings_for`)
    settings: ClassVar[dict[str, Any]] = {}

    @property
    @abstractmethod
    def model_dir(self) -> Path: ...

    @abstractmethod
    def build_model(self) -> Path:
        """Build the model if it is not complete (localstack's builders); its directory."""

    @abstractmethod
    def rows(self, count: int, settings: TrainSettings) -> list[dict[str, Any]]:
        """`count` task instances, drawn from the settings' seed."""

    def sampling(self, settings: TrainSettings) -> dict[str, Any]:
        return {"max_tokens": settings.max_tokens_per_turn, "temperature": settings.temperature}

    def action_mask(self, tokenizer: Any, vocab_size: int) -> FiniteActionMask | None:
        """The grammar's mask the server samples under, rebuilt on the trainer's side; None: no grammar."""
        return None

    @abstractmethod
    def probe_text(self) -> str:
        """Text that the weight-sync probe scores: the task's own prompt keeps it in the model's usual context."""


class RelayWorkload(Workload):
    name = "relay"
    task = "relay"
    max_turns = TURNS

    @property
    def model_dir(self) -> Path:
        return localstack.TINY_MODEL

    def build_model(self) -> Path:
        return localstack.build_tiny_model()

    def rows(self, count: int, settings: TrainSettings) -> list[dict[str, Any]]:
        return relay_instances(count, settings.seed, settings.tool_latency_median_s)

    def sampling(self, settings: TrainSettings) -> dict[str, Any]:
        return {**super().sampling(settings), "regex": relay_regex()}

    def action_mask(self, tokenizer: Any, vocab_size: int) -> FiniteActionMask:
        return FiniteActionMask.for_tokenizer(relay_turn_texts(), tokenizer, vocab_size)

    def probe_text(self) -> str:
        return RelayTask().user_prompt({})


class ArithmeticWorkload(Workload):
    name = "arithmetic"
    task = ArithmeticTask.name
    action_format = "fenced"  # the task's default too; said here so the request carries it whatever the task says
    # One turn: a python block, run in the sandbox, graded by running it again at eval. Measured: given 2-3
    # turns, the untrained model wrote no ```finish block in 64 episodes (docs/cpu-trainer.md), so later turns
    # cost tokens and training time without a way to be rewarded.
    max_turns = 1
    max_context_tokens = 2048
    settings = {
        # Measured on this 2-core CPU (docs/cpu-trainer.md): one GRPO step of 16 episodes takes 1-3 minutes.
        "groups_per_step": 2,
        "group_size": 8,
        "ppo_epochs": 1,
        # LoRA by measurement (docs/cpu-trainer.md): one update of 16 rows took half the time of full
        # fine-tuning (34 s against 68 s) at 80% of its peak memory. Full fine-tuning: --lora-rank 0 with a
        # learning rate about ten times smaller (1e-5).
        "lora_rank": 16,
        "learning_rate": 1e-4,
        "max_tokens_per_turn": 128,
        # Measured over 64 episodes (docs/cpu-trainer.md): 6.2% at 1.0, 17.2% at 0.7 with the stop at the closing
        # fence, 6 of 8 groups mixed. The trainer scores softmax(logits / 0.7), what vLLM samples and reports.
        "temperature": 0.7,
        "micro_batch_rows": 2,
        # Measured (docs/benchmarks.md, bench_learning_real): about 33 s a step, the reward up from ~0.2 to
        # ~0.8 within 10 steps; 20 steps show where it settles, 13-14 minutes a run.
        "steps": 20,
    }

    @property
    def model_dir(self) -> Path:
        return localstack.REAL_MODEL

    def build_model(self) -> Path:
        return localstack.build_real_model()

    def sampling(self, settings: TrainSettings) -> dict[str, Any]:
        # The turn ends where its first block closes: measured, the untrained model often follows a right block
        # with more blocks (the last block is the action) or text that opens one and never closes it.
        return {**super().sampling(settings), "stop": [CLOSING_FENCE]}

    def rows(self, count: int, settings: TrainSettings) -> list[dict[str, Any]]:
        return arithmetic_instances(count, settings.seed, settings.arithmetic_level())

    def probe_text(self) -> str:
        return ArithmeticTask().user_prompt({"question": "What is 41 * 38?"})


CLOSING_FENCE = "\n```\n"  # an opening fence names its language ("```python"), so this is a block's end


WORKLOADS: dict[str, Workload] = {w.name: w for w in (RelayWorkload(), ArithmeticWorkload())}


def workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"no workload {name!r}: one of {', '.join(WORKLOADS)}") from None
