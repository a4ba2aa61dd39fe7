"""Write a verl dataset (parquet) whose rows the `prorl_agent` loop runs as `python_math` episodes.

    python examples/verl/make_dataset.py --out ~/data/prorl_math

Each row is what verl's RLHFDataset reads (`prompt`, `data_source`, `reward_model`) plus the task instance in
`extra_info.instance`, which the agent loop sends to the rollout service. The questions are generated
arithmetic (no download), hard enough for a small model to need its Python tool now and then.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path


def row(rng: random.Random, index: int, split: str) -> dict:
    a, b, c = rng.randint(100, 9999), rng.randint(100, 9999), rng.randint(2, 97)
    question = f"What is ({a} * {b}) mod {c}?"
    answer = str((a * b) % c)
    return {
        "data_source": "prorl/python_math",
        "prompt": [{"role": "user", "content": question}],  # verl filters by its length; the service builds its own
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "instance": {"question": question, "answer": answer}},
    }


def main() -> None:
    import pandas as pd

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=4096)
    parser.add_argument("--test", type=int, default=256)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split, count in (("train", args.train), ("test", args.test)):
        pd.DataFrame([row(rng, i, split) for i in range(count)]).to_parquet(args.out / f"{split}.parquet")
        print(f"wrote {count} rows to {args.out / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
