"""The CPU trainer's real-model workload without servers: the arithmetic rows and their grading, the requests it
makes (fenced actions, no grammar), the batch and actor with no action mask (the plain softmax), gradients
accumulated over micro-batches, and LoRA weights pushed merged. The actor tests use the tiny model: they check
arithmetic of tensors, which needs no realism, in seconds."""

import ast
import asyncio
import operator

import pytest
import torch

pytest.importorskip("verl", reason="the CPU trainer uses verl's core_algos: install the project's [train] extra")

from prorl_adapter.dev import localstack
from prorl_adapter.service.actions import FORMATS
from prorl_adapter.tasks import EpisodeState
from prorl_adapter.testing import ScriptedSandbox
from prorl_adapter.trainer.samples import trajectory_from_tensors
from prorl_plugins.cpu_trainer.batch import pad_items
from prorl_plugins.cpu_trainer.train import TrainSettings, episode_requests
from prorl_plugins.cpu_trainer.workloads import CLOSING_FENCE, workload
from prorl_plugins.tasks.arithmetic import PROGRAM_PATH, ArithmeticLevel, ArithmeticTask, arithmetic_instances
from tests.test_batch_item import item

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.BinOp):
        return OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
    assert isinstance(node, ast.Constant)
    return node.value


def expression(row) -> str:
    return row["question"].removeprefix("What is ").removesuffix("?")


def test_arithmetic_rows_are_seeded_and_their_answers_right():
    level = ArithmeticLevel(operations=2, min_digits=2, max_digits=3)
    rows = arithmetic_instances(50, seed=3, level=level)
    assert rows == arithmetic_instances(50, seed=3, level=level)
    assert rows != arithmetic_instances(50, seed=4, level=level)
    assert len({r["id"] for r in rows}) == 50
    for row in rows:
        tree = ast.parse(expression(row), mode="eval").body
        numbers = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        assert len(numbers) == 3 and all(10 <= n <= 999 for n in numbers), row
        assert int(row["answer"]) == evaluate(tree), row
    assert {op for r in rows for op in "+-*" if f" {op} " in r["question"]} == {"+", "-", "*"}


def test_an_arithmetic_level_rejects_what_it_cannot_draw():
    with pytest.raises(ValueError, match="operations"):
        ArithmeticLevel(operations=0)
    with pytest.raises(ValueError, match="digits"):
        ArithmeticLevel(min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="operators"):
        ArithmeticLevel(operators=("/",))


PRINTED = {"print(12 * 34 - 5)": ("Calculating\n403\n", 0), "print(404)": ("404\n", 0)}


def python3(call, sandbox):
    """Runs answered as python3 would answer them for the programs below (a script: nothing runs)."""
    if call.kind == "run":
        return PRINTED.get(sandbox.files[call.argv[-1]].decode(), ("Traceback ...\nNameError\n", 1))
    return None


def test_arithmetic_grades_the_finish_answer_and_asks_for_the_blocks():
    task = ArithmeticTask()
    instance = {"question": "What is 12 * 34 - 5?", "answer": "403"}
    prompt = task.user_prompt(instance)
    assert prompt.endswith("What is 12 * 34 - 5?") and "```python" in prompt  # the question last, after the example
    assert task.action_format == "fenced"

    def score(answer):
        state = EpisodeState(answer=answer)
        return asyncio.run(task.evaluate(None, instance, state))["outcome"]

    assert score("403") == 1.0 and score("403.") == 1.0 and score("\\boxed{403}") == 1.0
    assert score("404") == 0.0 and score(None) == 0.0
    # what the model writes: a ```finish block's text is the answer the grading reads
    tools = {tool.name: tool for tool in task.tools(instance)}
    parsed = FORMATS["fenced"].parse("The result is:\n```finish\n403\n```", tools)
    assert parsed.calls[0].name == "finish" and score(parsed.calls[0].arguments["answer"]) == 1.0


def test_without_a_finish_answer_the_last_program_is_run_again_and_its_last_line_graded():
    task = ArithmeticTask()
    instance = {"question": "What is 12 * 34 - 5?", "answer": "403"}
    python = {tool.name: tool for tool in task.tools(instance)}["python"]

    def episode(*programs, answer=None):
        sandbox, state = ScriptedSandbox(python3), EpisodeState(answer=answer)
        for code in programs:  # the policy's python blocks, through the task's own tool
            asyncio.run(python.run(sandbox, {"code": code}, state))
        return asyncio.run(task.evaluate(sandbox, instance, state))["outcome"], sandbox

    right, sandbox = episode("print(404)", "print(12 * 34 - 5)")
    runs = [call.argv for call in sandbox.calls if call.kind == "run"]
    assert right == 1.0 and runs == [["python3", PROGRAM_PATH]]  # run at eval, the last block
    assert episode("print(12 * 34 - 5)", "print(404)")[0] == 0.0
    assert episode("print(undefined)")[0] == 0.0  # a program that fails scores nothing
    assert episode("print(12 * 34 - 5)", answer="404")[0] == 0.0  # a finish answer is what is graded
    assert episode()[0] == 0.0  # no program, no answer


def test_the_real_workload_asks_for_fenced_actions_without_a_grammar():
    settings = TrainSettings.for_workload("arithmetic", group_size=4)
    rows = workload("arithmetic").rows(2, settings)
    requests = episode_requests(settings, rows)
    assert len(requests) == 8 and {r.task for r in requests} == {"arithmetic"}
    assert all(r.action_format == "fenced" and r.sampling.regex is None for r in requests)
    assert all(
        r.sampling.temperature == settings.temperature < 1.0 and r.sampling.max_tokens == settings.max_tokens_per_turn
        for r in requests
    )
    assert all(r.sampling.stop == [CLOSING_FENCE] for r in requests)  # a turn ends where its first block does
    assert [r.group for r in requests] == [rows[0]["id"]] * 4 + [rows[1]["id"]] * 4
    assert settings.micro_batch_rows and settings.max_tokens_per_turn >= 128
    # the tiny model's workload keeps its grammar
    relay = episode_requests(TrainSettings(group_size=2), workload("relay").rows(1, TrainSettings()))
    assert all(r.sampling.regex and r.action_format is None and r.task == "relay" for r in relay)


def test_settings_for_a_workload_take_its_defaults_then_the_overrides():
    assert TrainSettings.for_workload("relay") == TrainSettings()
    real = TrainSettings.for_workload("arithmetic", steps=3)
    assert real.workload == "arithmetic" and real.steps == 3 and real.ppo_epochs == 1
    with pytest.raises(ValueError, match="no workload 'chess'"):
        TrainSettings.for_workload("chess")


def episode(prompt, response, mask, reward, group, job):
    logprobs = [-1.0 if m else 0.0 for m in mask]
    trajectory = trajectory_from_tensors(prompt, response, mask, logprobs, 0, 0, reward=reward, job_id=job)
    return item(trajectory.model_copy(update={"group": group}))


def episodes():
    """Two groups of rows of unlike lengths (so micro-batches pad differently), rewards that differ in each."""
    return [
        episode([1, 2, 3], [5, 6, 7, 8], [1, 1, 0, 1], 1.0, "a", "a0"),
        episode([1, 2], [9, 10], [1, 1], 0.0, "a", "a1"),
        episode([1, 2, 3, 4, 5], [11, 12, 13, 14, 15, 16], [1, 0, 0, 1, 1, 1], 0.5, "a", "a2"),
        episode([4, 3], [17], [1], 1.0, "b", "b0"),
        episode([4, 3, 2, 1], [18, 19, 20], [1, 1, 1], 0.0, "b", "b1"),
    ]


@pytest.fixture(scope="module")
def tiny_model():
    if not (localstack.TINY_MODEL / "config.json").exists():
        pytest.skip(f"the tiny model is not built at {localstack.TINY_MODEL}: run `make llm`")
    return localstack.TINY_MODEL


def test_with_no_mask_the_actor_scores_the_plain_softmax(tiny_model):
    from prorl_plugins.cpu_trainer.actor import TorchActor

    batch = pad_items(episodes(), pad_token_id=0)
    assert batch.allowed is None
    actor = TorchActor(tiny_model, learning_rate=0.0)
    with torch.no_grad():
        scored = actor.logprobs(batch)
    for row, sample in enumerate(episodes()):
        t = sample.trajectory
        full = t.prompt_ids + t.response_ids
        expected = actor.sequence_logprobs(full)[len(t.prompt_ids) - 1 :]  # logprob of each response token
        expected = torch.tensor(expected) * torch.tensor(t.response_mask, dtype=torch.float32)
        assert torch.allclose(scored[row, : len(t.response_ids)], expected, atol=1e-5)
        assert (scored[row, len(t.response_ids) :] == 0).all()


def test_at_a_temperature_the_actor_scores_the_softmax_of_the_logits_over_it(tiny_model):
    """What vLLM samples from at temperature T, and reports (--logprobs-mode processed_logprobs)."""
    from prorl_plugins.cpu_trainer.actor import TorchActor

    batch = pad_items(episodes(), pad_token_id=0)
    actor = TorchActor(tiny_model, learning_rate=0.0, temperature=0.5)
    with torch.no_grad():
        scored = actor.logprobs(batch)
        for row, sample in enumerate(episodes()):
            t = sample.trajectory
            logits = actor.model(input_ids=torch.tensor([t.prompt_ids + t.response_ids])).logits[0]
            at_t = torch.log_softmax(logits[len(t.prompt_ids) - 1 : -1] / 0.5, -1)
            expected = at_t.gather(-1, torch.tensor(t.response_ids).unsqueeze(-1)).squeeze(-1)
            expected = expected * torch.tensor(t.response_mask, dtype=torch.float32)
            assert torch.allclose(scored[row, : len(t.response_ids)], expected, atol=1e-5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        TorchActor(tiny_model, learning_rate=0.0, temperature=0.0)


def test_micro_batches_accumulate_the_whole_batchs_gradient(tiny_model):
    """One row per pass or all rows at once: the same advantages, logprobs, loss and gradient (lr 0, so the
    weights stay put and the gradients can be compared)."""
    from prorl_plugins.cpu_trainer.actor import TorchActor

    batch = pad_items(episodes(), pad_token_id=0)
    whole = TorchActor(tiny_model, learning_rate=0.0, seed=1)
    micro = TorchActor(tiny_model, learning_rate=0.0, seed=1, micro_batch_rows=2)
    assert len(micro.micro_batches(batch)) == 3 and sorted(
        r for part in micro.micro_batches(batch) for r in part
    ) == list(range(5))
    stats_whole, before_whole = whole.update(batch)
    stats_micro, before_micro = micro.update(batch)
    assert torch.allclose(before_whole, before_micro, atol=1e-5)
    assert stats_whole.pg_loss == pytest.approx(stats_micro.pg_loss, abs=1e-5)
    assert stats_whole.grad_norm == pytest.approx(stats_micro.grad_norm, rel=1e-4) and stats_whole.grad_norm > 0
    for (name, a), b in zip(whole.model.named_parameters(), micro.model.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-4), name


def test_a_selected_micro_batch_is_those_rows_with_their_padding_cut():
    batch = pad_items(episodes(), pad_token_id=0)
    part = batch.select([1, 3])
    assert part.input_ids.tolist() == [[1, 2, 9, 10], [4, 3, 17, 0]]
    assert part.response_mask.tolist() == [[1, 1], [1, 0]]
    assert part.token_level_rewards.tolist() == [[0, 0.0], [1.0, 0]]
    assert list(part.groups) == ["a", "b"] and part.policy_tokens == 3


def test_lora_trains_adapters_only_and_pushes_merged_full_weights(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from prorl_plugins.cpu_trainer.actor import TorchActor

    actor = TorchActor(tiny_model, learning_rate=1e-2, lora_rank=4)
    frozen = {n: p.detach().clone() for n, p in actor.model.named_parameters() if not p.requires_grad}
    actor.update(pad_items(episodes(), pad_token_id=0))
    assert all(torch.equal(frozen[n], p) for n, p in actor.model.named_parameters() if n in frozen)
    saved = actor.save(tmp_path / "weights")
    plain = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    assert not any("lora" in name for name, _ in plain.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 5, 6, 7, 8]])
    with torch.no_grad():
        served, trained, untrained = (m(input_ids=ids).logits for m in (plain, actor.model, base))
    assert torch.allclose(served, trained, atol=1e-4)  # what vLLM gets is what the trainer scores
    assert not torch.allclose(served, untrained, atol=1e-4)  # and the step moved it
