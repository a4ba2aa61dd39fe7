"""The rollout viewer's screenshots in docs/viewer.md (docs/img/viewer-*.png): a records directory of sample
episodes of the shell task, tokenised with the tiny model's tokenizer (`make llm` builds it), served by
`prorl-rollout view`, photographed by headless Chromium (prorl_adapter/dev/browser.py) at 1400x900.

    .venv/bin/python scripts/viewer_screenshots.py [--out docs/img]

The episodes are made up (no model ran): their texts, rewards, versions and logprobs are chosen to show what
each view shows.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prorl_adapter.dev.browser import records_viewer, screenshot  # noqa: E402
from prorl_adapter.models import JobError, JobState, StageTimings, ToolCall, Trajectory, Turn  # noqa: E402
from prorl_adapter.service.chat import ChatTokenizer  # noqa: E402
from prorl_adapter.service.records import Records  # noqa: E402

TOKENIZER = REPO / "models" / "tiny-qwen2"
SYSTEM = "You operate a Linux shell. Call the bash tool once per turn; call finish with the answer."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
EPISODE = [  # (what the policy says, the command it calls, what the tool answers)
    ("Let me look at the workspace first.", "ls -la /workspace", "total 8\n-rw-r--r-- 1 agent agent 42 notes.txt"),
    ("The notes may say what to do.", "cat /workspace/notes.txt", "Create /workspace/goal-reached, then finish."),
    ("I will create the file the check looks for.", "touch /workspace/goal-reached", ""),
]


def episode(chat: ChatTokenizer, job_id: str, rng: random.Random, version: int, reward: float, turns: int):
    """A shell episode of `turns` turns as the service would record it: the template's prompt, each sampled turn
    (mask 1, with logprobs) and the tool turn after it (mask 0)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Reach the goal in /workspace."}]
    prompt = chat.prompt_ids(messages, TOOLS)
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    recorded = []
    for index, (said, command, output) in enumerate(EPISODE[:turns]):
        text = f'{said}\n<tool_call>\n{{"name": "bash", "arguments": {{"command": "{command}"}}}}\n</tool_call>'
        sampled = [*chat.encode(text), chat.eos_id]
        turn_version = version + (1 if index == turns - 1 and turns > 2 else 0)
        recorded.append(
            Turn(
                index=index,
                policy_version=turn_version,
                llm_server="http://127.0.0.1:8000",
                response_start=len(response),
                response_tokens=len(sampled),
                finish_reason="stop",
                text=text,
                tool_calls=[ToolCall(name="bash", arguments={"command": command})],
                observation=output,
                observation_tokens=0,
                generate_s=round(rng.uniform(0.2, 0.9), 2),
                tools_s=round(rng.uniform(0.05, 0.3), 2),
            )
        )
        response += sampled
        mask += [1] * len(sampled)
        logprobs += [math.log(rng.choice([0.97, 0.95, 0.9, 0.8, 0.6, 0.4, 0.2, 0.05])) for _ in sampled]
        tool = chat.tool_turn_ids([{"role": "tool", "content": output}], closed_by_eos=True)
        recorded[-1].observation_tokens = len(tool)
        response += tool
        mask += [0] * len(tool)
        logprobs += [0.0] * len(tool)
    failed = reward == 0.0 and turns == 1
    return Trajectory(
        job_id=job_id,
        task="shell",
        instance_id=f"goal-{job_id[-2:]}",
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        response_logprobs=logprobs,
        turns=recorded,
        num_turns=len(recorded),
        finish_reason="error" if failed else "finish",
        reward=reward,
        reward_components={"outcome": reward, "step_cost": -0.01 * turns},
        policy_version_min=version,
        policy_version_max=max(t.policy_version for t in recorded),
        timings=StageTimings(
            queued_s=round(rng.uniform(0, 0.5), 2),
            init_s=round(rng.uniform(0.3, 1.2), 2),
            run_s=round(sum(t.generate_s + t.tools_s for t in recorded) + 0.2, 2),
            eval_s=round(rng.uniform(0.1, 0.4), 2),
            generate_s=round(sum(t.generate_s for t in recorded), 2),
            tools_s=round(sum(t.tools_s for t in recorded), 2),
        ),
        error=JobError(error_class="eval", message="the check timed out after 30 s") if failed else None,
        filter=failed,
        labels={"run": "demo", "split": "train" if int(job_id[-2:]) % 4 else "eval"},
        group=f"prompt-{int(job_id[-2:]) // 4}",
    ), JobState.failed if failed else JobState.done


def write_records(directory: Path, chat: ChatTokenizer) -> None:
    rng = random.Random(7)
    records = Records(directory, "rollout-1")
    for n in range(14):
        turns = 3 if n % 3 else 2 if n % 2 else 1
        reward = 0.0 if turns == 1 else 1.0 if turns == 3 else 0.5
        trajectory, state = episode(chat, f"job-{n:02d}", rng, 3 + n // 5, reward, turns)
        records.prorl_job_finished(trajectory, state)
    records.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args()
    if not TOKENIZER.is_dir():
        print(f"{TOKENIZER} is missing: run make llm", file=sys.stderr)
        return 2
    chat = ChatTokenizer(str(TOKENIZER))
    with tempfile.TemporaryDirectory(prefix="prorl-viewer-") as tmp:
        # Run from a folder of its own, with names as a user would give them (the page shows them).
        write_records(Path(tmp) / "runs" / "demo", chat)
        (Path(tmp) / "models").symlink_to(TOKENIZER.parent)
        with records_viewer("runs/demo", "--tokenizer", "models/tiny-qwen2", cwd=Path(tmp)) as url:
            args.out.mkdir(parents=True, exist_ok=True)
            shots = {
                "viewer-jobs.png": url,
                "viewer-conversation.png": f"{url}#job=job-13",
                "viewer-tokens.png": f"{url}#job=job-13&tab=tokens",
            }
            for name, page in shots.items():
                screenshot(page, args.out / name)
                print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
