"""The SkyRL backend hooks against SkyRL's real types and functions: the GeneratorInput SkyRL's trainer builds
(`prepare_generator_input`, `get_sampling_params_for_backend`), and the checks and tensors it applies to a
GeneratorOutput (`validate_generator_output`, `convert_prompts_responses_to_batch_tensors`). No services."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("skyrl", reason="SkyRL is not installed: pip install -e '.[torch,skyrl]'")
pytest.importorskip("loguru", reason="SkyRL's trainer needs loguru: pip install -e '.[skyrl]'")

from prorl_adapter.hooks import PluginConfigError, PluginSet
from prorl_adapter.models import BatchItem, TrajectoryWeight
from prorl_adapter.trainer.samples import trajectory_from_tensors
from prorl_plugins.skyrl import compat  # noqa: F401  (SkyRL on Python 3.11: before any skyrl import)

# isort: split
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.train.config import SamplingParams as SkyRLSampling
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
from skyrl.train.generators.utils import prepare_generator_input
from skyrl.train.utils.trainer_utils import validate_generator_output

from prorl_plugins.skyrl.config import ProRLConfig, ProRLSkyRLConfig, check
from prorl_plugins.skyrl.generator import ProRLGenerator
from prorl_plugins.skyrl.hooks import STEP_LABEL, TRAJECTORY_LABEL, SkyRLBackend
from prorl_plugins.staleness import StalenessControl

SHELL = {"goal": "Create done.txt.", "check": "test -f done.txt"}
MATH = {"question": "1+1?", "answer": "2"}


def generator_input(rows, n=2, step=5, **sampling):
    """A GeneratorInput as SkyRL's trainer builds it from dataloader rows."""
    params = get_sampling_params_for_backend("vllm", SkyRLSampling(**sampling))
    prompts = [
        {"prompt": [{"role": "user", "content": "x"}], "env_class": env, "env_extras": extras, "uid": str(i)}
        for i, (env, extras) in enumerate(rows)
    ]
    batch, _ = prepare_generator_input(prompts, n, params, "python_math", "train", step)
    return batch


def trajectory(job_id, version, mask, reward=1.0, finish="finish", filter=False):
    logprobs = [-0.5 if m else 0.0 for m in mask]
    ids = list(range(10, 10 + len(mask)))
    trajectory = trajectory_from_tensors(
        [1, 2, 3], ids, mask, logprobs, version, version, reward, job_id, task="shell", finish_reason=finish
    )
    return trajectory.model_copy(update={"filter": filter})


def test_real_generator_input_becomes_one_job_per_row():
    backend = SkyRLBackend()
    batch = generator_input(
        [("shell", {"instance": SHELL, "data_source": "mine"}), (None, {"instance": json.dumps(MATH)})],
        max_generate_length=48,
        temperature=0.7,
        additional_kwargs={"regex": "a+", "seed": 3},
    )
    jobs = backend.prorl_backend_requests(batch=batch, config={"max_turns": 3, "max_context_tokens": 1024})
    assert [j.task for j in jobs] == ["shell", "shell", "python_math", "python_math"]  # env_class, else default
    assert [j.instance for j in jobs] == [SHELL, SHELL, MATH, MATH]
    assert [j.group for j in jobs] == ["0", "0", "1", "1"]  # SkyRL's uid groups GRPO samples
    assert [j.labels[TRAJECTORY_LABEL] for j in jobs] == ["0_0", "0_1", "1_0", "1_1"]
    assert {j.labels[STEP_LABEL] for j in jobs} == {"5"}
    sampling = jobs[0].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.regex, sampling.seed) == (48, 0.7, "a+", 3)
    assert (jobs[0].max_turns, jobs[0].max_context_tokens) == (3, 1024)
    assert backend.prorl_backend_policy_version(batch=batch) == 4  # global step 5: the weights after 4 updates


def test_a_sampling_setting_the_service_cannot_honour_is_an_error():
    batch = generator_input([("shell", {"instance": SHELL})], top_k=50)
    with pytest.raises(ValueError, match="top_k=50"):
        SkyRLBackend().prorl_backend_requests(batch=batch, config={})


def test_a_row_without_an_instance_is_an_error_naming_its_columns():
    batch = generator_input([("shell", {"goal": "x", "data_source": "mine"})])
    with pytest.raises(ValueError, match=r"'instance' column.*data_source, goal"):
        SkyRLBackend().prorl_backend_requests(batch=batch, config={})
    with pytest.raises(ValueError, match="not valid JSON"):
        SkyRLBackend().prorl_backend_requests(batch=generator_input([("shell", {"instance": "{x"})]), config={})


def test_unknown_settings_are_an_error_and_a_batch_without_metadata_has_no_version():
    backend = SkyRLBackend()
    batch = generator_input([("shell", {"instance": SHELL})])
    with pytest.raises(ValueError, match="max_turn"):
        backend.prorl_backend_requests(batch=batch, config={"max_turn": 3})
    batch.pop("batch_metadata")
    assert backend.prorl_backend_policy_version(batch=batch) is None  # the driver then weighs at the newest


def test_output_passes_skyrl_checks_and_carries_the_staleness_weights():
    """Fresh, half-stale, too stale, and an infrastructure failure with no response at all; weighed by the real
    staleness plugin (linear, K=2) at version 4, as the generator does."""
    plugins = PluginSet.load(objects=[StalenessControl({"mode": "linear", "max_staleness": 2})], entry_points=False)
    mask = [1, 1, 0, 0, 1]
    trajectories = [
        trajectory("fresh", 4, mask, reward=1.0),
        trajectory("half", 3, mask, reward=0.5, finish="max_turns"),
        trajectory("stale", 2, mask, reward=1.0),
        trajectory("failed", 4, [], reward=0.0, finish="error", filter=True),
    ]
    items = [BatchItem(id=t.job_id, weight=plugins.weigh(t, 4), trajectory=t) for t in trajectories]
    assert [i.weight.sample for i in items] == [1.0, 0.5, 0.0, 1.0]
    batch = generator_input([("shell", {"instance": SHELL}), ("shell", {"instance": SHELL})], step=4)
    output = SkyRLBackend(filler_token_id=0).prorl_backend_batch(items=items, batch=batch)
    validate_generator_output(4, output)  # SkyRL's own check of a generator's answer
    assert output["loss_masks"] == [mask, [0.5, 0.5, 0.0, 0.0, 0.5], [0] * 5, [0]]
    assert output["response_ids"][3] == [0] and output["rollout_logprobs"][3] == [0.0]  # the filler token
    # Untrainable rows get their group's trainable mean (each is its own group here, with none: 0.0).
    assert output["rewards"] == [1.0, 0.5, 0.0, 0.0]
    assert output["stop_reasons"] == ["stop", "length", "stop", "error"]
    assert output["trajectory_ids"] == batch["trajectory_ids"]
    assert output["rollout_metrics"]["prorl/untrainable"] == 2.0
    assert output["rollout_metrics"]["prorl/infra_failures"] == 1.0
    # SkyRL's loss multiplies each token's loss by its loss_mask: the tensor keeps the fractional weight.
    tokenizer = SimpleNamespace(pad_token_id=0)
    rewards = [[0.0] * (len(r) - 1) + [reward] for r, reward in zip(output["response_ids"], output["rewards"])]
    tensors = convert_prompts_responses_to_batch_tensors(
        tokenizer, output["prompt_token_ids"], output["response_ids"], rewards, output["loss_masks"]
    )
    assert tensors[4][1].tolist() == [0.5, 0.5, 0.0, 0.0, 0.5]


def test_importance_token_weights_reach_the_loss_mask():
    weight = TrajectoryWeight(sample=1.0, tokens=[2.0, 0.5, 1.0])
    batch = generator_input([("shell", {"instance": SHELL})], n=1)
    output = SkyRLBackend().prorl_backend_batch(
        items=[BatchItem(id="t", weight=weight, trajectory=trajectory("t", 1, [1, 1, 0]))], batch=batch
    )
    assert output["loss_masks"] == [[2.0, 0.5, 0.0]]  # tool tokens stay out whatever their weight


def test_an_empty_response_without_a_filler_token_is_an_error():
    batch = generator_input([("shell", {"instance": SHELL})], n=1)
    with pytest.raises(ValueError, match="filler_token_id"):
        SkyRLBackend().prorl_backend_batch(
            items=[BatchItem(id="t", trajectory=trajectory("t", 1, [], filter=True))], batch=batch
        )


def test_config_section_is_checked_before_training():
    base = ["prorl.rollout_url=http://rollout:8766", "generator.max_turns=4"]
    cfg = ProRLSkyRLConfig.from_cli_overrides(
        [*base, "prorl.plugin_config={staleness: {mode: drop, max_staleness: 1}}"]
    )
    assert check(cfg).plugin_config == {"staleness": {"mode": "drop", "max_staleness": 1}}
    with pytest.raises(ValueError, match=r"prorl\.rollout_url"):
        check(ProRLSkyRLConfig.from_cli_overrides(["generator.max_turns=4"]))
    with pytest.raises(ValueError, match="step_wise_trajectories"):
        check(ProRLSkyRLConfig.from_cli_overrides([*base, "generator.step_wise_trajectories=true"]))
    with pytest.raises(ValueError, match="no `prorl` section"):
        check(SimpleNamespace(generator=cfg.generator))
    with pytest.raises(ValueError, match=r"rollout_ur.*for ProRLConfig"):  # SkyRL's strict parse refuses a typo
        ProRLSkyRLConfig.from_cli_overrides([*base, "prorl.rollout_ur=http://x"])


def test_generator_from_config_reads_skyrl_knobs_and_the_plugin_file(tmp_path):
    config_file = tmp_path / "plugins.json"
    config_file.write_text(json.dumps({"staleness": {"mode": "linear", "max_staleness": 3}}))
    cfg = ProRLSkyRLConfig.from_cli_overrides(
        ["prorl.rollout_url=http://rollout:8766", f"prorl.plugin_config_file={config_file}", "generator.max_turns=4"]
    )
    generator = ProRLGenerator.from_config(cfg, SimpleNamespace(eos_token_id=7))
    assert generator.request_config["max_turns"] == 4
    assert generator.request_config["max_context_tokens"] == cfg.generator.max_input_length
    assert generator.backend.filler_token_id == 7
    assert generator.plugins.config == {"staleness": {"mode": "linear", "max_staleness": 3}}
    cfg.prorl.plugin_config = {"staleness": {"mode": "off"}}
    with pytest.raises(ValueError, match="not both"):
        ProRLGenerator.from_config(cfg)


def test_a_plugin_section_no_plugin_reads_fails_at_construction():
    with pytest.raises(PluginConfigError, match="stalenes"):
        ProRLGenerator("http://rollout:8766", {"stalenes": {"mode": "drop"}})


def test_entry_point_overrides_get_generator_and_strips_the_override_argument():
    pytest.importorskip("ray", reason="SkyRL's trainer needs ray: pip install -e '.[skyrl]'")
    from prorl_plugins.skyrl import entrypoint  # an import error here is a bug, not a reason to skip

    cfg = entrypoint.parse_config(
        ["trainer.override_entrypoint=prorl_plugins.skyrl.entrypoint", "prorl.rollout_url=http://rollout:8766"]
    )
    assert isinstance(cfg.prorl, ProRLConfig)
    exp = object.__new__(entrypoint.ProRLPPOExp)  # BasePPOExp.__init__ loads datasets and a model's tokenizer
    generator = exp.get_generator(cfg, SimpleNamespace(eos_token_id=2), inference_engine_client=None)
    assert isinstance(generator, ProRLGenerator) and generator.rollout_url == "http://rollout:8766"


def with_second_sequence(t, policy_tokens: int):
    """`t` plus a second token sequence (its harness rewrote its history) of `policy_tokens` sampled tokens."""
    from prorl_adapter.models import Segment

    segment = Segment(
        prompt_ids=[1, 9],
        response_ids=list(range(40, 40 + policy_tokens)),
        response_mask=[1] * policy_tokens,
        response_logprobs=[-0.3] * policy_tokens,
    )
    return t.model_copy(update={"segments": [segment]})


def test_step_wise_trajectories_give_each_sequence_a_row_as_skyrl_checks_them():
    split = BatchItem(id="a", trajectory=with_second_sequence(trajectory("a", 4, [1, 0, 1], reward=1.0), 2))
    plain = BatchItem(id="b", trajectory=trajectory("b", 4, [1, 1], reward=0.0))
    batch = generator_input([("shell", {"instance": SHELL})], n=2, step=5)
    output = SkyRLBackend(filler_token_id=0, step_wise=True).prorl_backend_batch(items=[split, plain], batch=batch)
    validate_generator_output(2, output, step_wise=True)  # SkyRL's own check, step-wise rules included
    assert output["is_last_step"] == [False, True, True]
    assert output["response_ids"] == [[10, 11, 12], [40, 41], [10, 11]]
    assert output["prompt_token_ids"][1] == [1, 9] and output["rewards"] == [1.0, 1.0, 0.0]
    ids = batch["trajectory_ids"]
    assert output["trajectory_ids"] == [ids[0], ids[0], ids[1]]


def test_without_step_wise_trajectories_the_sequence_with_most_policy_tokens_is_trained():
    split = BatchItem(id="a", trajectory=with_second_sequence(trajectory("a", 4, [1, 0, 0]), 3))
    batch = generator_input([("shell", {"instance": SHELL})], n=1, step=5)
    output = SkyRLBackend(filler_token_id=0).prorl_backend_batch(items=[split], batch=batch)
    validate_generator_output(1, output)
    assert output["response_ids"] == [[40, 41, 42]] and output["is_last_step"] is None
    assert output["rollout_metrics"]["prorl/dropped_policy_tokens"] == 1.0
