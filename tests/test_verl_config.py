"""The verl plugin lines, composed into verl's real config by hydra, and what a wrong line says."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install -e '.[verl]'")

from prorl_adapter.models import StageTimings, ToolCall, Trajectory, Turn
from prorl_plugins.reward_shaping import RewardShaping
from prorl_plugins.verl.agent_loop import output_extra_fields
from prorl_plugins.verl.check import compose_verl_config, main
from prorl_plugins.verl.config import (
    AGENT_LOOP_NAME,
    ProrlVerlConfig,
    ProrlVerlConfigError,
    check_verl_config,
    verl_lines,
)
from prorl_plugins.verl.reward import compute_score

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verl" / "run_grpo.sh"
BLOCK = ["+prorl.service_url=http://127.0.0.1:8766", "+prorl.task=python_math"]
STALENESS = ["+prorl.staleness.mode=linear", "+prorl.staleness.max_staleness=2"]


def test_agent_loop_is_registered_by_name():
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    assert _agent_loop_registry[AGENT_LOOP_NAME] == {"_target_": "prorl_plugins.verl.agent_loop.ProrlAgentLoop"}


def test_the_plugin_lines_compose_into_verls_config():
    config = compose_verl_config(verl_lines(staleness=True, reward_in_verl=True) + BLOCK + STALENESS)
    assert config.actor_rollout_ref.model.external_lib == "prorl_plugins.verl"
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == AGENT_LOOP_NAME
    assert dict(config.trainer.v1.sampler.sampler_kwargs.staleness) == {"mode": "linear", "max_staleness": 2}
    prorl = check_verl_config(config)
    assert prorl.staleness_config.max_staleness == 2 and prorl.task == "python_math"


def example_overrides() -> list[str]:
    """The overrides in examples/verl/run_grpo.sh, with its shell variables filled in."""
    text = EXAMPLE.read_text().split("ARGS=(", 1)[1].split("\n)", 1)[0].replace('"$@"', "")
    for name, value in {
        "$MODEL": "Qwen/Qwen2.5-1.5B-Instruct",
        "$DATA": "/tmp/data",
        "$SERVICE_URL": "http://127.0.0.1:8766",
        "$SANDBOX_URL": "http://127.0.0.1:8765",
    }.items():
        text = text.replace(name, value)
    return shlex.split(text)


def test_every_key_of_the_gpu_example_exists_in_verl():
    config = compose_verl_config(example_overrides())  # hydra fails on a key verl does not have
    prorl = check_verl_config(config)
    assert prorl.reward_source == "service" and prorl.staleness_config.mode == "linear"
    assert config.algorithm.adv_estimator == "grpo"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], r"needs a `prorl` block.*\+prorl.service_url="),
        (["+prorl.task=shell"], r"prorl.service_url is missing"),
        (["+prorl.service_url=localhost:8766", "+prorl.task=shell"], r"not an http\(s\) URL"),
        ([*BLOCK, "+prorl.servce=1"], r"unknown key prorl.servce; known keys"),
        ([*BLOCK, "+prorl.staleness.mode=linaer"], r"staleness.mode"),
        ([*BLOCK, "+prorl.reward.weights.step_cost=-1"], r"reward.weights.step_cost"),
        ([*BLOCK, "+prorl.sampling.temperature=0.5"], r"set actor_rollout_ref.rollout.temperature"),
        (
            [*verl_lines(), *BLOCK, *STALENESS, "algorithm.filter_groups.enable=True"],
            r"filter_groups \(DAPO\) would silently do nothing",
        ),
        ([*BLOCK, *STALENESS], r"custom_sampler.path=pkg://prorl_plugins.verl.sampler"),
        (
            [*verl_lines(), *BLOCK, *STALENESS, "algorithm.rollout_correction.rollout_is=token"],
            r"would overwrite",
        ),
        (
            [*verl_lines(), *BLOCK, "+prorl.staleness.mode=importance", "+prorl.staleness.max_staleness=2"],
            r"algorithm.rollout_correction.rollout_is=token",
        ),
        ([*BLOCK, "+prorl.reward_source=verl"], r"reward.custom_reward_function.path=pkg://prorl_plugins.verl.reward"),
    ],
)
def test_a_wrong_line_says_what_to_fix(overrides, message):
    with pytest.raises(ProrlVerlConfigError, match=message):
        check_verl_config(compose_verl_config(overrides))


def test_preflight_command(capsys):
    assert main([*BLOCK, "--no-network"]) == 0
    assert main(["+prorl.task=shell", "--no-network"]) == 2
    assert "service_url is missing" in capsys.readouterr().err
    assert main(["+prorl.service_url=http://127.0.0.1:1", "+prorl.task=shell"]) == 2  # nothing listens on port 1
    assert "does not answer /healthz" in capsys.readouterr().err
    assert main(["+prorl.task=shell", "actor_rollout_ref.rollout.no_such_key=1", "--no-network"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def shell_trajectory() -> Trajectory:
    turns = [
        Turn(index=0, policy_version=3, llm_server="x", response_tokens=4, finish_reason="stop",
             text='<tool_call>{"name": "bash", "arguments": {"command": "rm -rf /"}}</tool_call>',
             tool_calls=[ToolCall(name="bash", arguments={"command": "rm -rf /"})]),
        Turn(index=1, policy_version=4, llm_server="x", response_tokens=3, finish_reason="stop",
             text="<tool_call>oops"),
    ]  # fmt: skip
    return Trajectory(
        job_id="j", task="shell", prompt_ids=[1, 2], response_ids=[5, 6, 7, 8, 9, 10, 11],
        response_mask=[1, 1, 1, 1, 1, 1, 1], response_logprobs=[-0.1] * 7, turns=turns, num_turns=2,
        finish_reason="max_turns", reward_components={"outcome": 1.0}, policy_version_min=3, policy_version_max=4,
        timings=StageTimings(),
    )  # fmt: skip


def test_verl_reward_function_equals_the_service_shaping():
    """The number the service's eval stage gives (the shared plugin, as the service runs it) is the number
    verl's custom_reward_function gives from the fields the agent loop hands over."""
    section = {"weights": {"safety": 2.0, "format": 0.5, "step_cost": 0.1, "outcome": 2.0}}
    shaping = RewardShaping()
    shaping.prorl_configure({"reward": section})
    trajectory = shell_trajectory()
    extra = shaping.prorl_reward_components(trajectory, {})
    service_components = {**trajectory.reward_components, **extra}
    service_reward = shaping.prorl_combine_reward(trajectory, service_components)
    assert service_reward == pytest.approx(2.0 - 2.0 - 0.5 - 0.2)
    shaped = trajectory.model_copy(update={"reward": service_reward, "reward_components": service_components})

    prorl = ProrlVerlConfig.from_block(
        {"service_url": "http://h:1", "task": "shell", "reward_source": "verl", "reward": section}
    )
    fields = output_extra_fields(prorl, shaped, {"goal": "x"})
    assert fields["min_global_steps"] == 3 and fields["max_global_steps"] == 4
    result = compute_score(data_source="prorl", solution_str="", ground_truth=None, extra_info=dict(fields))
    assert result["score"] == pytest.approx(service_reward)
    assert result["prorl/safety"] == pytest.approx(-2.0) and result["prorl/format"] == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="prorl_agent"):
        compute_score(extra_info={})


def test_the_verl_plugins_entry_point_registers_the_agent_loop():
    from importlib.metadata import entry_points

    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    (entry_point,) = [e for e in entry_points(group="verl.plugins") if e.name == "prorl"]
    entry_point.load()  # what `import verl` does with the group
    assert _agent_loop_registry["prorl_agent"]["_target_"] == "prorl_plugins.verl.agent_loop.ProrlAgentLoop"
