"""One GRPO update step of the real model, full fine-tuning against LoRA: seconds and peak memory.

    python -m prorl_plugins.cpu_trainer.bench_update [--episodes 16] [--prompt 180] [--response 260] [--ranks 0 16]

Each configuration runs in a process of its own (so its peak RSS is its own), on the same batch: `episodes`
rows of `prompt` prompt tokens and `response` response tokens (three policy spans with tool output between,
as an arithmetic episode of two or three turns has), drawn from the seed, in two GRPO groups whose rewards
differ. It times `TorchActor.update` (one epoch, micro-batches as the workload sets them) and the weight save
that a push needs (for LoRA: merge into a copy, then save), one thread as the trainer runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from prorl_adapter.dev import localstack
from prorl_adapter.models import BatchItem, TrajectoryWeight
from prorl_adapter.trainer.samples import trajectory_from_tensors

from .actor import TorchActor
from .batch import PaddedBatch, pad_items


def synthetic_batch(episodes: int, prompt: int, response: int, vocab: int, seed: int = 0) -> PaddedBatch:
    generator = torch.Generator().manual_seed(seed)
    mask = [1] * response
    tool = max(response // 8, 1)
    for start in (response // 3, 2 * response // 3):  # two tool outputs inside the response
        mask[start : start + tool] = [0] * tool
    items = []
    for k in range(episodes):
        ids = torch.randint(100, vocab, (prompt + response,), generator=generator).tolist()
        logprobs = [-2.0 if m else 0.0 for m in mask]
        t = trajectory_from_tensors(ids[:prompt], ids[prompt:], mask, logprobs, 0, 0, reward=float(k % 3 == 0))
        t = t.model_copy(update={"job_id": f"e{k}", "group": f"g{k % 2}"})
        items.append(BatchItem(id=t.job_id, trajectory=t, weight=TrajectoryWeight()))
    return pad_items(items, pad_token_id=0)


def measure(args: argparse.Namespace, rank: int) -> dict:
    torch.set_num_threads(args.threads)
    actor = TorchActor(localstack.REAL_MODEL, 1e-5, micro_batch_rows=args.micro_batch_rows, lora_rank=rank)
    batch = synthetic_batch(args.episodes, args.prompt, args.response, actor.vocab_size)
    loaded_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    actor.update(batch, epochs=1)
    updated = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        actor.save(Path(tmp) / "weights")
    saved = time.perf_counter()
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    return {
        "lora_rank": rank,
        "trainable_params": trainable,
        "update_s": round(updated - started, 1),
        "save_s": round(saved - updated, 1),
        "rss_after_load_mib": round(loaded_rss),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "episodes": args.episodes,
        "tokens_per_row": args.prompt + args.response,
        "micro_batch_rows": args.micro_batch_rows,
        "threads": args.threads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=180)
    parser.add_argument("--response", type=int, default=260)
    parser.add_argument("--micro-batch-rows", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 16])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: measure this rank, print JSON
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args, args.one)))
        return 0
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    for rank in args.ranks:
        cmd = [sys.executable, "-m", "prorl_plugins.cpu_trainer.bench_update", *passed, "--one", str(rank)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(done.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
