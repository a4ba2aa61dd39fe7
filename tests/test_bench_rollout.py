"""bench/bench_rollout.py's real-model workload and its accounting, without a server: the jobs it submits read the
model's actions as text (fenced, no regex), and the report counts every generated token, a turn without an action
included, and splits each turn's time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prorl_adapter.models import ToolCall, Turn

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))

import bench_rollout  # noqa: E402


def turn(index: int, tokens: int, text: str, calls=(), errors=(), generate_s=1.0, tools_s=0.0, cut=False) -> Turn:
    return Turn(
        index=index,
        policy_version=0,
        llm_server="http://llm",
        response_start=0,
        response_tokens=tokens,
        finish_reason="length" if cut else "stop",
        text=text,
        tool_calls=list(calls),
        tool_call_errors=list(errors),
        generate_s=generate_s,
        tools_s=tools_s,
    )


def test_the_real_workload_asks_for_fenced_actions_without_a_regex():
    workload = bench_rollout.arithmetic_workload(6, seed=3)
    requests = bench_rollout.requests_for(workload, "t")
    assert [r.job_id for r in requests] == [f"t-{i}" for i in range(6)]
    for request, instance in zip(requests, workload.instances, strict=True):
        assert request.task == "arithmetic" and request.action_format == "fenced"
        assert request.sampling.regex is None and request.sampling.seed is None
        assert request.sampling.max_tokens == bench_rollout.REAL_MAX_TOKENS
        assert request.max_turns == bench_rollout.REAL_MAX_TURNS
        assert request.instance == instance and {"question", "answer"} <= set(instance)
        assert instance["question"].startswith("What is ") and instance["answer"].lstrip("-").isdigit()
    # The same seed makes the same instances (every mode and round runs the same episodes).
    assert bench_rollout.arithmetic_workload(6, seed=3) == workload
    assert "arithmetic" in workload.summary(3) and "no regex" in workload.summary(3)


def test_the_tiny_workload_is_unchanged():
    request = bench_rollout.requests_for(bench_rollout.fixed_workload(2, seed=3), "t")[0]
    assert request.task == "shell" and request.action_format is None
    assert request.sampling.regex == bench_rollout.REGEX and request.max_turns == bench_rollout.FIXED_TURNS


def test_tokens_count_every_turn_and_the_actions_are_classified():
    turns = [
        turn(
            0,
            120,
            "```python\nprint(1)\n```",
            calls=[ToolCall(name="python", arguments={"code": "print(1)"})],
            tools_s=0.5,
        ),
        turn(1, 160, "```python\nprint(", errors=["a code block was opened with ``` but never closed"], cut=True),
        turn(2, 40, "The answer is 1."),  # no block: the episode ends, its tokens were generated all the same
    ]
    result = bench_rollout.episode_result(turns, 0.0, None, init_s=0.1, run_s=4.0, finish_reason="no_tool_call")
    assert result.response_tokens == 320 and result.turn_tokens == [120, 160, 40]
    assert result.turn_kinds == ["python", bench_rollout.PARSE_ERROR, bench_rollout.NO_BLOCK]
    assert result.tools_s == [0.5]  # the tiny model's figure: turns that ran tools
    assert result.parse_errors == ["a code block was opened with ``` but never closed"] and result.cut_turns == 1
    assert result.llm_s == 3.0 and result.all_tools_s == 0.5

    finished = bench_rollout.episode_result(
        [turn(0, 30, "```finish\n42\n```", calls=[ToolCall(name="finish", arguments={"answer": "42"})])],
        1.0,
        None,
        init_s=0.1,
        run_s=2.0,
        wait_s=0.5,
    )
    cpu = {"vLLM engine core + worker": 8.0, bench_rollout.WHOLE_MACHINE: 16.0}
    run = bench_rollout.ModeResult("coupled", 0.0, 10.0, [result, finished], 1.0, 0, cpu)
    assert run.tokens == 350 and run.turns == 4 and run.tokens_per_turn() == pytest.approx(87.5)
    assert run.kinds() == {"python": 1, "finish": 1, bench_rollout.PARSE_ERROR: 1, bench_rollout.NO_BLOCK: 1}
    assert run.action_share() == pytest.approx(0.5)
    split = run.turn_split()
    assert split["turn"] == pytest.approx(1.5) and split["llm"] == pytest.approx(1.0)
    assert split["tools"] == pytest.approx(0.125) and split["wait"] == pytest.approx(0.125)
    assert split["orchestration"] == pytest.approx(0.25)

    pipeline = bench_rollout.ModeResult("pipeline", 0.0, 5.0, [result, finished], 1.0, 0, {})
    pipeline.stage_means = dict.fromkeys(("queued_s", "init_s", "run_s", "eval_s", "generate_s", "tools_s"), 1.0)
    table = bench_rollout.real_table({"coupled": [run], "pipeline": [pipeline]})
    assert "| **episodes/s** | **0.200** | **0.400** | 2.00x |" in table
    assert "| **turns with a parsable action** | 50% | 50% | — |" in table

    # The whole section renders from these figures (what a run writes at its end, after minutes of measuring).
    args = bench_rollout.parse_args(["--model", "real", "--episodes", "2"])
    topology = bench_rollout.Topology("shared cores", frozenset({0, 1}), frozenset({0, 1}))
    workload = bench_rollout.arithmetic_workload(2, seed=1)
    setting = bench_rollout.Setting(topology, workload, {"coupled": [run], "pipeline": [pipeline]})
    block = bench_rollout.render_real_block([setting], args, "a machine", "everything on CPUs 0,1", [])
    assert block.startswith(bench_rollout.REAL_BLOCK_START) and block.rstrip().endswith(bench_rollout.REAL_BLOCK_END)
    assert "python bench/bench_rollout.py --model real --episodes 2" in block
    assert "1 turns ran into max_tokens" in block and "1x 'a code block was opened" in block
    assert "other tenants the rest (8 of 16 core-seconds)" in block


def test_the_real_section_goes_next_to_the_tiny_one_and_leaves_the_rest_alone(tmp_path):
    tiny = f"{bench_rollout.BLOCK_START}\n## tiny\n{bench_rollout.BLOCK_END}"
    others = "<!-- bench_runtime:start -->\nruntime\n<!-- bench_runtime:end -->"
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n{others}\n\n{tiny}\n\n<!-- after:start -->\nx\n<!-- after:end -->\n")
    block = lambda n: f"{bench_rollout.REAL_BLOCK_START}\n## real {n}\n{bench_rollout.REAL_BLOCK_END}\n"  # noqa: E731
    bench_rollout.write_real_section(doc, block(1))
    expected = f"# Benchmarks\n\n{others}\n\n{tiny}\n\n{block(1)}\n<!-- after:start -->\nx\n<!-- after:end -->\n"
    assert doc.read_text() == expected
    bench_rollout.write_real_section(doc, block(2))
    assert doc.read_text() == expected.replace("## real 1", "## real 2")


def test_the_real_model_has_its_own_defaults_and_workload():
    args = bench_rollout.parse_args(["--model", "real"])
    assert (args.workload, args.episodes, args.rounds, args.topology) == ("arithmetic", 32, 1, "shared")
    assert args.warm_sandboxes == 0 and args.target_engine_batch == 0
    tiny = bench_rollout.parse_args([])
    assert (tiny.workload, tiny.episodes, tiny.rounds, tiny.topology) == ("both", 128, 2, "both")
    assert tiny.warm_sandboxes == 64 and tiny.target_engine_batch == 32
    with pytest.raises(SystemExit):
        bench_rollout.parse_args(["--model", "real", "--workload", "fixed"])
    with pytest.raises(SystemExit):
        bench_rollout.parse_args(["--workload", "arithmetic"])
