"""Writes a SkyRL dataset whose rows are rollout-service episodes: `prompt` (what SkyRL logs and length-checks),
`env_class` (the rollout task) and `instance` (the task instance, as JSON text so any task's fields fit in one
parquet column).

    python examples/skyrl/make_dataset.py --out ~/data/prorl-shell
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from datasets import Dataset


def shell_rows(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        instance = {
            "goal": f"Create the file result{i}.txt in the working directory.",
            "check": f"test -f result{i}.txt",
        }
        rows.append(
            {
                "prompt": [{"role": "user", "content": instance["goal"]}],
                "env_class": "shell",
                "instance": json.dumps(instance),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--validation", type=int, default=8)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(shell_rows(args.train)).to_parquet(str(args.out / "train.parquet"))
    Dataset.from_list(shell_rows(args.validation)).to_parquet(str(args.out / "validation.parquet"))
    print(f"wrote {args.out}/train.parquet and validation.parquet")


if __name__ == "__main__":
    main()
