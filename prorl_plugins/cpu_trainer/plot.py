"""The reward-per-step plot written next to the training log."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .train import StepRecord


def plot_rewards(records: Sequence[StepRecord], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no screen: render straight to PNG
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    figure, reward_axis = plt.subplots(figsize=(7, 3.6), dpi=110)
    reward_axis.plot(steps, [r.reward for r in records], marker="o", markersize=3, label="mean reward")
    for name in sorted({name for r in records for name in r.reward_components}):
        values = [r.reward_components.get(name, 0.0) for r in records]
        reward_axis.plot(steps, values, linestyle="--", linewidth=1, label=name)
    reward_axis.set_xlabel("training step (policy version)")
    reward_axis.set_ylabel("reward")
    reward_axis.set_ylim(-0.1, 1.05)
    reward_axis.grid(alpha=0.3)
    reward_axis.legend(loc="upper left", fontsize=8)
    reward_axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
