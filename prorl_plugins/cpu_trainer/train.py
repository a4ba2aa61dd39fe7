"""Decoupled GRPO on CPU through the rollout service: the CPU training backend.

    rollout service (decoupled mode) ── POST /v1/batches ──> CpuTrainer.step ── reload_weights ──> vLLM
          ^  pace admission (staleness plugin)                  │ verl core_algos: GRPO advantages,
          └──────────── PUT /v1/policy-version, ack ────────────┘ clipped loss, staleness loss weights

The trainer queues every prompt up front (POST /v1/prompts); the service's staleness plugin decides when each
episode may start. Each step takes a batch of whole GRPO groups from the buffer, updates the torch actor,
pushes the weights to every vLLM server, verifies them there, publishes the new policy version and only then
acknowledges the batch (a trainer that dies mid-step loses nothing: the batch is redelivered).

What it trains on is the settings' workload (workloads.py): the tiny model on `relay` under a grammar (the
default), or the real SmolLM2-135M-Instruct on `arithmetic` in fenced text actions, no grammar, LoRA by default.

Like the verl and SkyRL backends it implements the backend hooks only (`CpuTrainerBackend`) and goes through
the driver (`RolloutDriver`: enqueue, take whole groups, to_batch, ack). It is the embedded default for
demonstrations and tests, not a replacement for verl.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from prorl_adapter.hooks import PluginSet, hookimpl
from prorl_adapter.models import BatchItem, JobRequest, WeightUpdateMode
from prorl_adapter.trainer import RolloutClient, RolloutDriver
from prorl_adapter.trainer.samples import job_request
from prorl_plugins.tasks.arithmetic import ArithmeticLevel

from .actor import TorchActor
from .batch import PaddedBatch, pad_items
from .constrained import FiniteActionMask
from .weight_sync import VllmWeightSync
from .workloads import Workload, workload


@dataclass
class TrainSettings:
    workload: str = "relay"  # workloads.WORKLOADS: the model, the task and how episodes are asked for
    steps: int = 30
    groups_per_step: int = 4  # prompts per step
    group_size: int = 8  # episodes per prompt, compared with each other by GRPO
    # Measured on the relay task (docs/cpu-trainer.md): with 1-2 epochs the policy often sat for 20+ steps at
    # 0.25, the best a policy blind to the turn index can do; 4 epochs at 3e-3 left it by step ~15.
    learning_rate: float = 3e-3
    ppo_epochs: int = 4
    clip_ratio: float = 0.2
    # What the PPO ratio is taken against (actor.ANCHORS): "proximal", the weights the step starts from with
    # behaviour importance weights capped at importance_cap (decoupled PPO), or "behaviour", the sampling policy.
    ppo_anchor: str = "proximal"
    importance_cap: float = 2.0
    staleness: dict[str, Any] = field(default_factory=lambda: {"mode": "pace", "max_staleness": 1})
    # The shared reward plugin's section: a cost per turn, so the log shows a shaped reward beside the task's
    # outcome (every relay episode takes two turns, so it shifts each group alike and GRPO is unmoved).
    reward: dict[str, Any] = field(default_factory=lambda: {"weights": {"outcome": 1.0, "step_cost": 0.01}})
    max_tokens_per_turn: int = 64
    # vLLM samples softmax(logits / temperature) and reports those logprobs (scripts/serve-vllm.sh starts it with
    # --logprobs-mode processed_logprobs); the actor scores the same distribution, so the ratio is honest.
    temperature: float = 1.0
    seed: int = 0
    tool_latency_median_s: float = 0.0  # > 0: relay's tools take time (relay_instances), the slow-tool workload
    take_timeout_s: float = 300.0
    # How the service's weight-update barrier ends the turns in flight while the weights are pushed: "drain"
    # (they finish with the old weights) or "abort" (aborted and resumed with the new ones: partial rollouts).
    weight_update: WeightUpdateMode = "drain"
    # Rows per forward/backward pass (gradients accumulated over the batch); None: the whole batch in one pass.
    # The real model's logits over 49,152 tokens do not fit a whole batch at once.
    micro_batch_rows: int | None = None
    lora_rank: int = 0  # 0: full fine-tuning; N: LoRA adapters of rank N (peft), pushed to vLLM merged
    lora_alpha: int | None = None  # None: 2 x rank
    # The arithmetic workload's questions (tasks.arithmetic.ArithmeticLevel)
    arithmetic_operations: int = 1
    arithmetic_min_digits: int = 1
    arithmetic_max_digits: int = 1

    @classmethod
    def for_workload(cls, name: str, **overrides: Any) -> TrainSettings:
        """The settings `name` trains with (its `Workload.settings` over the defaults), then `overrides`."""
        return cls(**{"workload": name, **workload(name).settings, **overrides})

    def arithmetic_level(self) -> ArithmeticLevel:
        return ArithmeticLevel(self.arithmetic_operations, self.arithmetic_min_digits, self.arithmetic_max_digits)

    @property
    def batch_size(self) -> int:
        return self.groups_per_step * self.group_size

    def plugin_config(self) -> dict[str, Any]:
        """The plugin configuration both the service and the trainer load (one source, so they agree)."""
        staleness = dict(self.staleness)
        if staleness.get("mode") == "pace":
            staleness.setdefault("batch_size", self.batch_size)
        return {"staleness": staleness, "reward": dict(self.reward)}


@dataclass
class StepRecord:
    step: int
    policy_version: int  # the version this step trained (it published version + 1)
    reward: float
    reward_components: dict[str, float]
    logprob_gap: float | None  # max |trainer - server| over tokens sampled at this version; None if none were
    fresh_tokens: int
    probe_gap: float  # the weight-sync probe after this step's push
    staleness: dict[int, int]  # staleness (versions) -> samples
    sample_weight_mean: float
    trainer_busy: float  # share of the step spent training and syncing, not waiting for the batch
    seconds: float
    pg_loss: float
    clip_fraction: float
    grad_norm: float
    importance_weight_mean: float | None = None  # None in records written before the proximal anchor existed


def episode_requests(settings: TrainSettings, rows: list[dict[str, Any]]) -> list[JobRequest]:
    """`group_size` episodes of each row, one GRPO group, as the settings' workload asks for them."""
    work = workload(settings.workload)
    requests = [
        job_request(
            work.task,
            row,
            group=row["id"],
            sampling=work.sampling(settings),
            max_turns=work.max_turns,
            max_context_tokens=work.max_context_tokens,
            labels={"run": "cpu-grpo"},
        )
        for row in rows
        for _ in range(settings.group_size)
    ]
    if work.action_format is not None:
        requests = [r.model_copy(update={"action_format": work.action_format}) for r in requests]
    return requests


class CpuTrainerBackend:
    """The hook implementations: the workload's rows to jobs, and taken items to the actor's padded batch."""

    def __init__(self, settings: TrainSettings, action_mask: FiniteActionMask | None, pad_id: int):
        self.settings = settings
        self.action_mask = action_mask
        self.pad_id = pad_id

    @hookimpl
    def prorl_backend_requests(self, batch: list[dict[str, Any]], config: dict[str, Any]) -> list[JobRequest]:
        return episode_requests(self.settings, batch)

    @hookimpl
    def prorl_backend_batch(self, items: list[BatchItem]) -> PaddedBatch:
        return pad_items(items, self.pad_id, self.action_mask)


class CpuTrainer:
    def __init__(
        self,
        settings: TrainSettings,
        model_dir: Path | None,
        rollout_url: str,
        llm_urls: list[str],
        run_dir: Path,
    ):
        torch.set_num_threads(1)  # on 2 cores the other one serves vLLM: a second thread here only fights it
        self.settings = settings
        self.workload: Workload = workload(settings.workload)
        model_dir = model_dir or self.workload.model_dir
        self.run_dir = run_dir
        self.rollout_url = rollout_url
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.actor = TorchActor(
            model_dir,
            settings.learning_rate,
            settings.clip_ratio,
            settings.seed,
            anchor=settings.ppo_anchor,
            importance_cap=settings.importance_cap,
            micro_batch_rows=settings.micro_batch_rows,
            lora_rank=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            temperature=settings.temperature,
        )
        self.action_mask = self.workload.action_mask(tokenizer, self.actor.vocab_size)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        backend = CpuTrainerBackend(settings, self.action_mask, pad_id or 0)
        self.plugins = PluginSet.load(settings.plugin_config(), objects=[backend])
        self.sync = VllmWeightSync(llm_urls)
        # Any text scores the weights; the task's own prompt keeps the probe in the model's usual context.
        self._probe = tokenizer.encode(self.workload.probe_text())

    def rows(self) -> list[dict[str, Any]]:
        """Every prompt of the run: `groups_per_step` of the workload's instances per step."""
        s = self.settings
        return self.workload.rows(s.steps * s.groups_per_step, s)

    async def run(self, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
        records: list[StepRecord] = []
        try:
            async with RolloutClient(self.rollout_url) as client:
                driver = RolloutDriver(client, self.plugins)
                # Version 0 is the trainer's weights: push them first, so a server that was serving anything
                # else (a previous run's weights) cannot produce version-0 samples.
                self._publish_weights()
                await driver.set_policy_version(0)
                await driver.enqueue(self.rows())
                for step in range(self.settings.steps):
                    records.append(await self._step(driver, step))
                    if on_step:
                        on_step(records[-1])
        finally:
            self.sync.close()
        return records

    def _publish_weights(self) -> float:
        """Save, push to every server, and check there that they arrived; the largest probe gap."""
        self.sync.push(self.actor.save(self.run_dir / "weights"))
        return self._verify_weights()

    def _verify_weights(self) -> float:
        return self.sync.verify(self._probe, self.actor.sequence_logprobs(self._probe))

    async def _step(self, driver: RolloutDriver, version: int) -> StepRecord:
        started = time.perf_counter()
        s = self.settings
        items = await driver.take(s.batch_size, s.take_timeout_s, group_size=s.group_size)
        training = time.perf_counter()
        batch: PaddedBatch = driver.to_batch(items)
        stats, logprobs = self.actor.update(batch, s.ppo_epochs)
        # Nothing generates while the weights change (the service's barrier); the probe is scored after the resume,
        # as a server paused in abort mode answers nothing before.
        async with driver.weight_update(version + 1, mode=s.weight_update):
            self.sync.push(self.actor.save(self.run_dir / "weights"))
        probe_gap = self._verify_weights()
        await driver.ack(items)
        finished = time.perf_counter()
        fresh = (batch.token_versions == version) & batch.response_mask.bool()
        gap = (logprobs - batch.behaviour_logprobs).abs()[fresh]
        components: dict[str, list[float]] = defaultdict(list)
        for item in items:
            for name, value in item.trajectory.reward_components.items():
                components[name].append(value)
        return StepRecord(
            step=version,
            policy_version=version,
            reward=statistics.fmean(i.trajectory.reward for i in items),
            reward_components={name: statistics.fmean(values) for name, values in components.items()},
            logprob_gap=float(gap.max()) if gap.numel() else None,
            fresh_tokens=int(fresh.sum()),
            probe_gap=probe_gap,
            staleness=dict(sorted(Counter(version - i.trajectory.policy_version_min for i in items).items())),
            sample_weight_mean=statistics.fmean(i.weight.sample for i in items),
            trainer_busy=(finished - training) / (finished - started),
            seconds=finished - started,
            pg_loss=stats.pg_loss,
            clip_fraction=stats.clip_fraction,
            grad_norm=stats.grad_norm,
            importance_weight_mean=stats.importance_weight_mean,
        )


def record_json(record: StepRecord) -> dict[str, Any]:
    data = asdict(record)
    data["staleness"] = {str(k): v for k, v in record.staleness.items()}
    return data
