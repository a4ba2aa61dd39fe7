"""The verl plugin lines, composed into verl's real config by hydra, and what a wrong line says."""

from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install -e '.[verl]'")

from prorl_adapter.hooks import PluginSet
from prorl_adapter.models import StageTimings, ToolCall, Trajectory, Turn
from prorl_plugins.staleness import StalenessConfig
from prorl_plugins.verl.backend import output_extra_fields
from prorl_plugins.verl.check import compose_verl_config, main
from prorl_plugins.verl.config import (
    AGENT_LOOP_NAME,
    ALWAYS,
    IMPORTANCE,
    LINEAR,
    LINES,
    REWARD_IN_VERL,
    STALENESS_ON,
    UNSET,
    ProrlVerlConfig,
    ProrlVerlConfigError,
    block_lines,
    check_service,
    check_verl_config,
    verl_lines,
)
from prorl_plugins.verl.reward import compute_score

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verl" / "run_grpo.sh"
BLOCK = ["+prorl.service_url=http://127.0.0.1:8766", "+prorl.task=python_math"]
STALENESS = block_lines("staleness", {"mode": "linear", "max_staleness": 2})
PLUGIN = verl_lines()  # the two lines every recipe has


def test_agent_loop_is_registered_by_name():
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    assert _agent_loop_registry[AGENT_LOOP_NAME] == {"_target_": "prorl_plugins.verl.agent_loop.ProrlAgentLoop"}


@pytest.mark.parametrize("mode", ["off", "drop", "linear", "pace", "importance"])
@pytest.mark.parametrize("reward_source", ["service", "verl"])
def test_the_printed_lines_pass_the_check_they_derive_from(mode, reward_source):
    section = {"mode": mode, "max_staleness": 2, "batch_size": 8}
    lines = [*verl_lines(section, reward_source), *BLOCK, *block_lines("staleness", section)]
    prorl = check_verl_config(compose_verl_config([*lines, f"+prorl.reward_source={reward_source}"]))
    assert prorl.staleness_config.mode == mode and prorl.reward_source == reward_source
    config = compose_verl_config(lines)
    assert config.actor_rollout_ref.model.external_lib == "prorl_plugins.verl"
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == AGENT_LOOP_NAME
    assert dict(config.trainer.v1.sampler.sampler_kwargs) == {}  # staleness is stated once, in the block


# A recipe that needs each row of the table: its staleness mode and reward source.
NEEDS = {ALWAYS: ("off", "service"), STALENESS_ON: ("drop", "service"), LINEAR: ("linear", "service")}
NEEDS |= {IMPORTANCE: ("importance", "service"), REWARD_IN_VERL: ("off", "verl")}


@pytest.mark.parametrize("line", LINES, ids=lambda line: f"{line.key}[{line.when}]")
def test_each_line_of_the_table_is_named_when_wrong(line):
    mode, reward_source = NEEDS[line.when]
    section = {"mode": mode, "max_staleness": 2}
    good = [*verl_lines(section, reward_source), *BLOCK, *block_lines("staleness", section)]
    good.append(f"+prorl.reward_source={reward_source}")
    check_verl_config(compose_verl_config(good))
    expected = line.expected(StalenessConfig.from_section(section))
    if expected is UNSET:
        wrong = f"+{line.key}=1"
    elif isinstance(expected, bool):
        wrong = f"{line.key}={not expected}"
    else:
        wrong = f"{line.key}=wrong_value"
    overrides = [o for o in good if not o.startswith(f"{line.key}=")] + [wrong]
    with pytest.raises(ProrlVerlConfigError, match=re.escape(line.key)):
        check_verl_config(compose_verl_config(overrides))


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


EXTERNAL_LIB, AGENT_LOOP = PLUGIN


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # the lines around the block, each case naming the line to write
        (
            [EXTERNAL_LIB, *BLOCK],  # no agent-loop line: verl's default single_turn_agent would run
            r"default_agent_loop=single_turn_agent is wrong.*write actor_rollout_ref.rollout.agent."
            r"default_agent_loop=prorl_agent$",
        ),
        (
            [EXTERNAL_LIB, "actor_rollout_ref.rollout.agent.default_agent_loop=prorl_agnt", *BLOCK],
            r"default_agent_loop=prorl_agnt is wrong.*write actor_rollout_ref.rollout.agent.default_agent_loop="
            r"prorl_agent$",
        ),
        (  # another loop on purpose, with the block: the block configures prorl_agent, so one of them is wrong
            [EXTERNAL_LIB, "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", *BLOCK],
            r"default_agent_loop=tool_agent is wrong",
        ),
        (
            [AGENT_LOOP, *BLOCK],
            r"external_lib is not set \(verl imports it.*\); write actor_rollout_ref.model.external_lib="
            r"prorl_plugins.verl$",
        ),
        (
            [AGENT_LOOP, "actor_rollout_ref.model.external_lib=prorl_plugins.verl.agent", *BLOCK],
            r"external_lib=prorl_plugins.verl.agent is wrong.*write actor_rollout_ref.model.external_lib=",
        ),
        (  # the second statement of staleness that recipes used to need
            [
                *PLUGIN,
                *BLOCK,
                *STALENESS,
                *verl_lines({"mode": "linear", "max_staleness": 2})[2:],
                "+trainer.v1.sampler.sampler_kwargs.staleness=${prorl.staleness}",
            ],
            r"sampler_kwargs.staleness is set .*stated once.*drop the line "
            r"\+trainer.v1.sampler.sampler_kwargs.staleness",
        ),
        (
            [
                *verl_lines({"mode": "importance", "max_staleness": 2}),
                *BLOCK,
                "+prorl.staleness.mode=importance",
                "+prorl.staleness.max_staleness=2",
                "+prorl.staleness.importance_cap=3",
            ],
            r"rollout_is_threshold=2.0 is wrong.*write algorithm.rollout_correction.rollout_is_threshold=3.0$",
        ),
        (
            [*BLOCK, *STALENESS],  # every missing line at once
            r"4 verl lines are wrong:\n.*external_lib.*\n.*default_agent_loop.*\n.*custom_sampler.path=pkg://"
            r"prorl_plugins.verl.sampler\n.*custom_sampler.name=StalenessReplayBuffer$",
        ),
        # the block itself
        ([], r"needs a `prorl` block.*\+prorl.service_url="),
        (["+prorl.task=shell"], r"prorl.service_url is missing"),
        (["+prorl.service_url=http://127.0.0.1:8766"], r"prorl.task is missing: add \+prorl.task=<task name"),
        (["+prorl.service_url=localhost:8766", "+prorl.task=shell"], r"not an http\(s\) URL"),
        ([*BLOCK, "+prorl.servce=1"], r"prorl.servce: Unexpected keyword argument \(known: .*service_url"),
        ([*BLOCK, "+prorl.staleness.mode=linaer"], r"staleness.mode"),
        ([*BLOCK, "+prorl.reward.weights.step_cost=-1"], r"reward.weights.step_cost"),
        ([*BLOCK, "+prorl.sampling.temperature=0.5"], r"set actor_rollout_ref.rollout.temperature"),
        (
            [
                *verl_lines({"mode": "drop", "max_staleness": 2})[:4],
                *BLOCK,
                *STALENESS,
                "algorithm.filter_groups.enable=True",
            ],
            r"filter_groups \(DAPO\) would silently do nothing",
        ),
        (
            [
                *verl_lines({"mode": "linear", "max_staleness": 2}),
                *BLOCK,
                *STALENESS,
                "algorithm.rollout_correction.rollout_is=token",
            ],
            r"would overwrite.*write algorithm.rollout_correction.rollout_is=null",
        ),
        (
            [*PLUGIN, *BLOCK, "+prorl.staleness.mode=importance", "+prorl.staleness.max_staleness=2"],
            r"algorithm.rollout_correction.rollout_is=token",
        ),
        (
            [*PLUGIN, *BLOCK, "+prorl.reward_source=verl"],
            r"reward.custom_reward_function.path=pkg://prorl_plugins.verl.reward",
        ),
    ],
)
def test_a_wrong_line_says_what_to_fix(overrides, message):
    with pytest.raises(ProrlVerlConfigError, match=re.compile(message, re.DOTALL | re.MULTILINE)):
        check_verl_config(compose_verl_config(overrides))


def test_external_lib_may_be_a_list_that_names_the_plugin():
    lines = [AGENT_LOOP, "actor_rollout_ref.model.external_lib=[my_models,prorl_plugins.verl]", *BLOCK]
    check_verl_config(compose_verl_config(lines))


def test_preflight_command(capsys):
    assert main([*PLUGIN, *BLOCK, "--no-network"]) == 0
    assert main(["+prorl.task=shell", "--no-network"]) == 2
    assert "service_url is missing" in capsys.readouterr().err
    assert main([*PLUGIN, "+prorl.service_url=http://127.0.0.1:1", "+prorl.task=shell"]) == 2  # nothing on port 1
    assert "does not answer /healthz" in capsys.readouterr().err
    assert main(["+prorl.task=shell", "actor_rollout_ref.rollout.no_such_key=1", "--no-network"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def shell_trajectory() -> Trajectory:
    turns = [
        Turn(index=0, policy_version=3, llm_server="x", response_start=0, response_tokens=4, finish_reason="stop",
             text='<tool_call>{"name": "bash", "arguments": {"command": "rm -rf /"}}</tool_call>',
             tool_calls=[ToolCall(name="bash", arguments={"command": "rm -rf /"})]),
        Turn(index=1, policy_version=4, llm_server="x", response_start=4, response_tokens=3, finish_reason="stop",
             text="<tool_call>oops", tool_call_errors=["unclosed <tool_call>"]),
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
    trajectory = shell_trajectory()  # as the task's eval left it: the outcome only
    service = PluginSet.load(config={"reward": section})  # the service's plugins, as it loads them
    service_components, service_reward = service.shaped_reward(trajectory, {}, trajectory.reward_components)
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


# -- the rollout service's side: its tasks and plugin sections, and one sample through the driver -------------
def block(**settings) -> ProrlVerlConfig:
    return ProrlVerlConfig.from_block({"service_url": "http://h:1", "task": "shell", **settings})


@pytest.mark.parametrize(
    ("prorl", "tasks", "sections", "message"),
    [
        (block(task="no_such_task"), ["python_math", "shell"], {}, r"no_such_task'? is not a task of the rollout "
         r"service at http://h:1, which has: python_math, shell; write \+prorl.task=<one of them>"),
        (block(task="python_mth"), ["python_math", "shell"], {}, r"write \+prorl.task=python_math"),
        (block(staleness={"mode": "linear", "max_staleness": 2}), None, {"staleness": {"mode": "drop",
         "max_staleness": 2}}, r"staleness is stated twice, and differently: the recipe has prorl.staleness="
         r"\{'mode': 'linear', 'max_staleness': 2\}, .* started with staleness=\{'mode': 'drop', 'max_staleness': 2\}"
         r".*\+prorl.staleness.mode=drop \+prorl.staleness.max_staleness=2$"),
        (block(), None, {"staleness": {"mode": "pace", "max_staleness": 1, "batch_size": 8}},
         r"the recipe has prorl.staleness=\(not stated\).*\+prorl.staleness.mode=pace"),
        (block(reward={"weights": {"step_cost": 0.5}}), None, {"reward": {"weights": {"step_cost": 0.25}}},
         r"the reward shaping is stated twice, and differently.*\+prorl.reward.weights.step_cost=0.25$"),
        (block(reward_source="verl"), None, {"reward": {"weights": {"format": 0.1}}},
         r"the recipe has prorl.reward=\(not stated\).*reward_source=verl.*\+prorl.reward.weights.format=0.1$"),
    ],
)  # fmt: skip
def test_what_the_service_says_must_agree_with_the_block(prorl, tasks, sections, message):
    with pytest.raises(ProrlVerlConfigError, match=re.compile(message, re.DOTALL)):
        check_service(prorl, tasks, sections)


def test_the_service_may_leave_staleness_to_the_recipe_or_say_the_same():
    linear = {"mode": "linear", "max_staleness": 2}
    check_service(block(staleness=linear), ["shell"], {})
    check_service(block(staleness=linear), ["shell"], {"staleness": dict(linear)})
    check_service(block(staleness=linear), ["shell"], {"staleness": {"mode": "off"}})
    check_service(block(), ["shell"], {"reward": {"weights": {"format": 0.1}}})  # reward_source=service: its own
    reward = {"weights": {"format": 0.1}}
    check_service(block(reward_source="verl", reward=reward), ["shell"], {"reward": {"weights": {"format": 0.1}}})


async def test_preflight_asks_the_service_for_its_tasks_and_sections(capsys):
    from tests.fakes.rigs import rollout_stack

    linear = {"mode": "linear", "max_staleness": 2}
    lines = [*verl_lines(linear), *block_lines("staleness", linear)]
    async with rollout_stack(plugin_config={"staleness": {"mode": "drop", "max_staleness": 2}}) as stack:
        service = [f"+prorl.service_url={stack.url}"]
        assert await asyncio.to_thread(main, [*PLUGIN, *service, "+prorl.task=no_such_task"]) == 2
        err = capsys.readouterr().err
        assert "'no_such_task' is not a task of the rollout service" in err and "python_math, relay, shell" in err
        assert await asyncio.to_thread(main, [*lines, *service, "+prorl.task=shell"]) == 2
        assert "staleness is stated twice, and differently" in capsys.readouterr().err
        drop = {"mode": "drop", "max_staleness": 2}
        same = [*verl_lines(drop), *block_lines("staleness", drop), *service, "+prorl.task=shell"]
        assert await asyncio.to_thread(main, same) == 0
        assert "the service has task shell and its plugin sections agree" in capsys.readouterr().out
    assert main([*PLUGIN, BLOCK[0], "+prorl.task=no_such_task", "--no-network"]) == 0
    assert "--no-network: the service, its tasks (is no_such_task one?) and its plugin sections not checked" in (
        capsys.readouterr().out
    )


async def test_one_verl_sample_through_the_driver():
    """The backend hooks on the real service: the row's job, the step's version, verl's output."""
    from prorl_adapter.trainer.driver import RolloutDriver
    from prorl_plugins.verl.backend import VerlBackend, VerlSample
    from prorl_plugins.verl.config import plugin_set
    from tests.fakes.llm import bash_call, finish_call
    from tests.fakes.rigs import CHECK, rollout_stack

    async with rollout_stack(script=[bash_call("touch /workspace/goal-reached"), finish_call()]) as stack:
        settings = {"max_turns": 4, "sampling": {"max_tokens": 200}}  # per turn; the response is cut to 16 tokens
        prorl = ProrlVerlConfig.from_block({"service_url": stack.url, "task": "shell", **settings})
        driver = RolloutDriver(stack.client, plugin_set({}, objects=[VerlBackend(prorl)]), shared_version=True)
        rollout = SimpleNamespace(prompt_length=4096, response_length=16, temperature=0.7, top_p=0.9)
        row = {"extra_info": {"instance": {"goal": "reach the goal", "check": CHECK}}, "uid": "u1", "global_steps": 3}
        output = await driver.generate(VerlSample(row=row, sampling_params={"temperature": 0.5}, rollout=rollout))
        trajectory = await stack.client.result(output.extra_fields["prorl_job_id"], wait=0)
        assert trajectory.group == "u1" and trajectory.num_turns == 2
        assert (await stack.client.status()).policy_version == 2  # step 3 runs with the weights after step 2
        assert trajectory.policy_version_min == 2 and output.extra_fields["min_global_steps"] == 2
        assert len(trajectory.response_ids) > 16 and len(output.response_ids) == 16  # cut to response_length
        assert output.response_ids == trajectory.response_ids[:16] and output.prompt_ids == trajectory.prompt_ids
        assert output.reward_score == trajectory.reward and output.num_turns == 2
        request = stack.llm.requests[0]
        assert request["temperature"] == 0.5 and request["top_p"] == 0.9  # the sample's, else verl's rollout config
        assert request["max_tokens"] == 200


def test_llm_servers_may_name_their_protocol_and_nothing_else():
    """An SGLang or ProRL /generate server listed in the block keeps its protocol prefix (the pool speaks it)."""
    good = "+prorl.llm_servers=[sglang+http://gpu-0:30000,http://gpu-1:8000,prorl+http://gpu-2:8000]"
    prorl = check_verl_config(compose_verl_config([*PLUGIN, *BLOCK, good]))
    assert prorl.llm_servers == ("sglang+http://gpu-0:30000", "http://gpu-1:8000", "prorl+http://gpu-2:8000")
    with pytest.raises(ProrlVerlConfigError, match="is not an http"):
        check_verl_config(compose_verl_config([*PLUGIN, *BLOCK, "+prorl.llm_servers=[gopher+http://gpu-0:1]"]))
    with pytest.raises(ProrlVerlConfigError, match=r"prorl\.service_url"):
        check_verl_config(compose_verl_config([*PLUGIN, "+prorl.service_url=sglang+http://h:1", "+prorl.task=shell"]))


async def test_verls_sglang_replicas_are_registered_as_sglang_servers():
    """verl's load balancer lists its replicas as ip:port; with the SGLang engine they name SGLang's protocol."""
    from prorl_plugins.verl.agent_loop import verl_server_urls

    class Registry:  # a stand-in for verl's load-balancer actor handle (`.remote()` answers an awaitable)
        async def remote(self):
            return ["10.0.0.1:30000", "http://10.0.0.2:30000"]

    manager = SimpleNamespace(_load_balancer=SimpleNamespace(get_all_servers=Registry()))
    assert await verl_server_urls(manager, "sglang") == ["sglang+http://10.0.0.1:30000", "sglang+http://10.0.0.2:30000"]
    assert await verl_server_urls(manager, "vllm") == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]


def test_verl_gets_the_episodes_sequence_with_the_most_policy_tokens():
    """verl 0.9.1's agent loop takes one sequence per sample: of an agent program's episode that rewrote its
    history, the sequence with the most policy tokens."""
    from prorl_adapter.models import BatchItem, Segment
    from prorl_adapter.trainer.samples import trajectory_from_tensors
    from prorl_plugins.verl.backend import VerlBackend, VerlSample

    first = trajectory_from_tensors([1, 2], [5, 6, 7], [1, 0, 0], [-0.5, 0.0, 0.0], 3, 3, 1.0, "j", task="shell")
    longer = Segment(prompt_ids=[1, 9], response_ids=[8, 8, 8], response_mask=[1, 1, 1], response_logprobs=[-1.0] * 3)
    item = BatchItem(id="j", trajectory=first.model_copy(update={"segments": [longer]}))
    prorl = ProrlVerlConfig.from_block({"service_url": "http://127.0.0.1:1", "task": "shell"})
    rollout = SimpleNamespace(prompt_length=64, response_length=16, temperature=1.0, top_p=1.0)
    row = {"extra_info": {"instance": {"goal": "g", "check": "true"}}, "uid": "u1"}
    output = VerlBackend(prorl).prorl_backend_batch(
        items=[item], batch=VerlSample(row=row, sampling_params={}, rollout=rollout)
    )
    assert (output.prompt_ids, output.response_ids, output.response_mask) == ([1, 9], [8, 8, 8], [1, 1, 1])
    assert output.reward_score == 1.0


def test_an_agent_program_in_the_block_runs_each_rows_episode():
    from prorl_plugins.verl.backend import VerlBackend, VerlSample

    block = {"service_url": "http://127.0.0.1:1", "task": "shell", "agent": {"command": "python3 /opt/agent.py"}}
    prorl = ProrlVerlConfig.from_block(block)
    rollout = SimpleNamespace(prompt_length=64, response_length=16, temperature=1.0, top_p=1.0)
    row = {"extra_info": {"instance": {"goal": "g", "check": "true"}}, "uid": "u1"}
    [request] = VerlBackend(prorl).prorl_backend_requests(
        batch=VerlSample(row=row, sampling_params={}, rollout=rollout)
    )
    assert request.agent.command == "python3 /opt/agent.py"
    with pytest.raises(ProrlVerlConfigError, match=r"prorl\.agent\.command: Field required"):
        ProrlVerlConfig.from_block({**block, "agent": {"cmd": "x"}})


# -- prorl.launch=ray: the run starts the rollout stack on verl's own Ray cluster -----------------------------
LAUNCH = ["+prorl.launch=ray", "+prorl.task=python_math"]


def test_a_launched_stack_needs_no_service_url():
    lines = [*PLUGIN, *LAUNCH, "+prorl.launch_replicas=2", "+prorl.runtime_resource=prorl_runtime"]
    prorl = check_verl_config(compose_verl_config(lines))
    assert (prorl.launch, prorl.service_url, prorl.launch_replicas) == ("ray", None, 2)
    assert (prorl.runtime_resource, prorl.launch_namespace) == ("prorl_runtime", None)
    defaults = ProrlVerlConfig.from_block({"launch": "ray", "task": "shell"})
    assert (defaults.launch_replicas, defaults.runtime_resource) == (1, None)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"launch": "slurm"}, r"prorl.launch: Input should be 'ray'"),
        ({"launch": "ray", "service_url": "http://h:1"}, r"prorl.service_url and prorl.launch=ray both say where"),
        ({"launch": "ray", "sandbox_url": "http://h:1"}, r"drop \+prorl.sandbox_url"),
        ({"service_url": "http://h:1", "launch_replicas": 2}, r"launch_replicas is a setting of a launched stack"),
        ({"service_url": "http://h:1", "runtime_resource": "r"}, r"add \+prorl.launch=ray"),
        ({"launch": "ray", "launch_replicas": 0}, r"prorl.launch_replicas: Input should be greater than 0"),
        ({"launch": "ray", "runtime_resource": ""}, r"prorl.runtime_resource: must be a name"),
        ({"launch": "ray", "runtime_host_paths": "/opt"}, r"runtime_host_paths: must be a list of absolute"),
        ({"launch": "ray", "runtime_host_paths": ["opt"]}, r"'opt' is not an absolute path"),
        ({"service_url": "http://h:1", "runtime_host_paths": ["/opt"]}, r"runtime_host_paths is a setting of a launch"),
        ({}, r"service_url is missing.*or \+prorl.launch=ray"),
    ],
)
def test_a_wrong_launch_setting_says_what_to_fix(block, message):
    with pytest.raises(ProrlVerlConfigError, match=message):
        ProrlVerlConfig.from_block({"task": "shell", **block})


def test_a_launched_stacks_runtimes_show_the_named_host_paths(monkeypatch):
    """Image-less sandboxes see no host path but /usr unless the runtime names it: agent programs need theirs."""
    from prorl_adapter.launch import ray_stack
    from prorl_plugins.verl import agent_loop

    calls = []
    monkeypatch.setattr(
        ray_stack.RayStack,
        "up_or_attach",
        staticmethod(
            lambda namespace, **up: calls.append(up) or SimpleNamespace(service_urls=["http://h:1"], token=None)
        ),
    )
    monkeypatch.setattr(
        ray_stack.ray, "get_runtime_context", lambda: SimpleNamespace(get_job_id=lambda: "1", get_actor_id=lambda: "w")
    )
    config = compose_verl_config([*PLUGIN, *LAUNCH, "+prorl.runtime_host_paths=[/opt/prorl-agent,/data/sets]"])
    agent_loop.launched_block(check_verl_config(config), config)
    assert calls[0]["runtime_args"] == ["--host-path", "/opt/prorl-agent", "--host-path", "/data/sets"]


def test_preflight_of_a_launched_stack_asks_no_service(capsys):
    assert main([*PLUGIN, *LAUNCH]) == 0  # no --no-network, and nothing to reach: the run starts it
    assert "launched on Ray, 1 replica(s)" in capsys.readouterr().out


def test_each_worker_starts_or_attaches_to_the_runs_stack_and_uses_one_replica(monkeypatch):
    from prorl_adapter.launch import ray_stack
    from prorl_plugins.verl import agent_loop

    calls = []

    def up_or_attach(namespace, **up):
        calls.append((namespace, up))
        return SimpleNamespace(service_urls=["http://10.0.0.1:1", "http://10.0.0.2:1"], token="stack-token")

    context = SimpleNamespace(get_job_id=lambda: "05000000", get_actor_id=lambda: "worker-a")
    monkeypatch.setattr(ray_stack.RayStack, "up_or_attach", staticmethod(up_or_attach))
    monkeypatch.setattr(ray_stack.ray, "get_runtime_context", lambda: context)
    config = compose_verl_config([*PLUGIN, *LAUNCH, "+prorl.launch_replicas=2", "actor_rollout_ref.model.path=/m/q"])
    prorl = check_verl_config(config)
    launched = agent_loop.launched_block(prorl, config)
    (namespace, up), *_ = calls
    assert namespace == "prorl-05000000"  # one stack per training run
    assert up == {
        "tokenizer": "/m/q",
        "replicas": 2,
        "runtime_resource": None,
        "token": None,
        "runtime_args": [],
        "detached": False,
    }
    assert launched.service_url in ("http://10.0.0.1:1", "http://10.0.0.2:1") and launched.token == "stack-token"
    assert agent_loop.launched_block(prorl, config).service_url == launched.service_url  # the same replica each time


async def test_a_private_load_balancer_that_is_gone_is_named_with_verls_version_and_the_line_that_avoids_it():
    from prorl_plugins.verl.agent_loop import VERL_READ, verl_server_urls

    with pytest.raises(
        ProrlVerlConfigError, match=rf"verl [\d.]+'s LLM server client has no `_load_balancer`.*{VERL_READ}"
    ):
        await verl_server_urls(SimpleNamespace(), "vllm")
    with pytest.raises(ProrlVerlConfigError, match=re.escape("+prorl.llm_servers=[http://host:port,...]")):
        await verl_server_urls(SimpleNamespace(), "vllm")


async def test_reading_it_from_another_verl_warns_once(monkeypatch, caplog):
    from prorl_plugins.verl import agent_loop

    class Registry:
        async def remote(self):
            return ["10.0.0.1:8000"]

    monkeypatch.setattr(agent_loop, "installed_verl", lambda: "9.9.9")
    agent_loop.warn_untested_verl.cache_clear()
    manager = SimpleNamespace(_load_balancer=SimpleNamespace(get_all_servers=Registry()))
    for _ in range(3):
        assert await agent_loop.verl_server_urls(manager, "vllm") == ["http://10.0.0.1:8000"]
    warnings = [r.getMessage() for r in caplog.records if "verl 9.9.9" in r.getMessage()]
    assert len(warnings) == 1 and "+prorl.llm_servers" in warnings[0]
    agent_loop.warn_untested_verl.cache_clear()


def test_a_workers_state_is_keyed_by_the_block_and_the_event_loop_never_by_an_id():
    """Equal blocks share state, different ones do not, and a closed event loop's sessions go with it (an id()
    key could hand a new block or loop the state of a collected one)."""
    import gc

    from prorl_plugins.verl import agent_loop

    prorl = check_verl_config(compose_verl_config([*PLUGIN, *BLOCK]))
    same = check_verl_config(compose_verl_config([*PLUGIN, *BLOCK]))
    other = check_verl_config(compose_verl_config([*PLUGIN, *BLOCK, "+prorl.max_turns=3"]))
    assert prorl is not same and agent_loop.block_key(prorl) == agent_loop.block_key(same)
    assert agent_loop.block_key(prorl) != agent_loop.block_key(other)

    async def session_and_driver():
        session = agent_loop._session(prorl)
        assert agent_loop._session(same) is session  # one client per service and loop
        assert session.driver(prorl) is session.driver(same) is not session.driver(other)
        await session.client.aclose()
        return session

    before = len(agent_loop._sessions)
    first, second = asyncio.run(session_and_driver()), asyncio.run(session_and_driver())
    assert first is not second  # a new loop: a new client, never one bound to the closed loop
    gc.collect()
    assert len(agent_loop._sessions) == before


def test_a_config_object_is_checked_once_however_many_samples_read_it(monkeypatch):
    from prorl_plugins.verl import agent_loop

    checks = []
    monkeypatch.setattr(agent_loop, "check_verl_config", lambda config: checks.append(config) or object())
    config, another = compose_verl_config([*PLUGIN, *BLOCK]), compose_verl_config([*PLUGIN, *BLOCK])
    for _ in range(3):
        assert agent_loop._settings(config) is agent_loop._settings(config)
    agent_loop._settings(another)
    assert checks == [config, another]
