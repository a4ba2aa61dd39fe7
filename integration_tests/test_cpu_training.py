"""The learning proof: decoupled GRPO on CPU through the rollout service (real vLLM, bwrap sandboxes, verl's
core_algos on a torch actor), and the reward rises; a weight push that does not arrive fails the run."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="the CPU trainer uses verl's core_algos: install the project's [train] extra")

from prorl_adapter.dev import localstack
from prorl_plugins.cpu_trainer.train import CpuTrainer, TrainSettings
from prorl_plugins.cpu_trainer.weight_sync import VllmWeightSync, WeightSyncError
from sandbox_runtime import procs

from .conftest import start_rollout


@pytest.fixture
def restore_weights(vllm):
    """The session's vLLM server is shared: whatever a test trained, it serves the built model again after."""
    yield
    sync = VllmWeightSync([vllm.url])
    sync.push(localstack.TINY_MODEL)
    sync.close()


def start_trainer(vllm, sandbox_server, tmp_path, settings: TrainSettings):
    config = tmp_path / "plugins.json"
    config.write_text(json.dumps(settings.plugin_config()))
    rollout = start_rollout([sandbox_server.url], [vllm.url], "--plugin-config", str(config))
    trainer = CpuTrainer(settings, localstack.TINY_MODEL, rollout.url, [vllm.url], tmp_path / "run")
    return rollout, trainer


@pytest.mark.slow
async def test_reward_rises_and_the_server_samples_from_the_trained_weights(
    vllm, sandbox_server, tmp_path, restore_weights
):
    settings = TrainSettings(steps=30, seed=0)  # measured: ~0.1 at first; left the 0.25 plateau at steps 15-20
    rollout, trainer = start_trainer(vllm, sandbox_server, tmp_path, settings)
    try:
        records = await trainer.run()
    finally:
        rollout.stop()
    outcome = [r.reward_components["outcome"] for r in records]
    first, last = statistics.fmean(outcome[:5]), statistics.fmean(outcome[-5:])
    assert last >= first + 0.25, f"no learning: outcome {first:.2f} over the first 5 steps, {last:.2f} over the last"
    gaps = [r.logprob_gap for r in records if r.logprob_gap is not None]
    assert gaps, "no step trained on tokens sampled at its own version"
    assert max(gaps) < 1e-4, f"trainer and server disagree on the same tokens by {max(gaps):.2g}"
    assert max(r.probe_gap for r in records) < 1e-4
    assert all(max(r.staleness) <= 1 for r in records), "pace with K=1 let a staler trajectory through"


class PushNothing(VllmWeightSync):
    """A broken weight push: the server is asked to reload the weights it started with."""

    def push(self, weights_dir):
        super().push(localstack.TINY_MODEL)


async def test_weights_that_do_not_reach_the_server_fail_the_run(vllm, sandbox_server, tmp_path, restore_weights):
    rollout, trainer = start_trainer(vllm, sandbox_server, tmp_path, TrainSettings(steps=2))
    with torch.no_grad():  # weights the server has never seen, whatever a step would have changed
        trainer.actor.model.lm_head.weight.add_(0.05)
    trainer.sync = PushNothing([vllm.url])
    try:
        with pytest.raises(WeightSyncError, match="did not reach"):
            await trainer.run()
    finally:
        rollout.stop()


def test_a_trainer_stopped_by_sigterm_stops_the_servers_it_started(tmp_path):
    """`prorl-train-cpu` starts vLLM, the runtime and the service in sessions of their own (so that stopping one
    reaches its whole tree), which also means they would outlive a trainer killed outright: SIGTERM must unwind
    it like Ctrl-C, and every process of every server it started must be gone when it has exited."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "prorl_plugins.cpu_trainer.cli", "--steps", "50", "--out", str(out)]
    stderr = tmp_path / "stderr"
    with stderr.open("w") as sink:
        trainer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=sink)
    servers: list[int] = []
    status = None
    try:
        steps = out / "steps.jsonl"
        deadline = time.monotonic() + 600
        # Training has begun once the first step is logged: every server is up by then.
        while not (steps.exists() and steps.read_text()):
            assert trainer.poll() is None, f"the trainer exited before its first step: {stderr.read_text()}"
            assert time.monotonic() < deadline, "no training step within 600 s"
            time.sleep(0.5)  # polls a file another process writes; nothing to wait on instead
        # vLLM, the runtime and the service each lead a session of their own (start_new_session).
        servers = [pid for pid in procs.children(trainer.pid) if procs.session_members(pid)]
        trainer.send_signal(signal.SIGTERM)
        status = trainer.wait(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the trainer was still running 180 s after SIGTERM; it printed: {stderr.read_text()[-3000:]}")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        left = {pid: commands(procs.session_members(pid)) for pid in servers if procs.session_members(pid)}
        for pid in left:  # a failure must not leave them running for the rest of the suite
            procs.kill_session(pid)
    assert len(servers) == 3, commands(servers)
    assert status == 128 + signal.SIGTERM, stderr.read_text()[-3000:]
    assert left == {}, f"processes of the trainer's servers still running after it exited: {left}"


def commands(pids: list[int]) -> list[str]:
    """Each process's command line, for a failure's message."""
    lines = []
    for pid in pids:
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            lines.append(f"{pid} (gone)")
    return lines
