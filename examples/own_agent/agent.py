"""A small agent of your own, on the official `openai` client: it reads its task from PRORL_TASK_PROMPT, runs
bash commands in the machine it is on, and stops when the model answers without a tool call.

Nothing in it knows about RL or prorl-adapter: it talks to whatever OPENAI_BASE_URL and OPENAI_API_KEY name.
Run through the rollout service (`run.py` next to it), it runs inside the episode's sandbox, its commands run
there, and every call it makes is recorded in token space by the service's LLM gateway.
"""

from __future__ import annotations

import json
import os
import subprocess

from openai import OpenAI

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command; returns its output and exit code.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


def bash(command: str) -> str:
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    return f"{(done.stdout + done.stderr)[-4000:]}[exit code {done.returncode}]"


def main(max_steps: int = 6) -> None:
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    messages = [
        {"role": "system", "content": "You solve tasks in a Linux shell. Use the bash tool."},
        {"role": "user", "content": os.environ["PRORL_TASK_PROMPT"]},
    ]
    for _ in range(max_steps):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[BASH]).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))  # sent back as it came: the token history holds
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            command = json.loads(call.function.arguments).get("command", "")
            print(f"$ {command}", flush=True)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": bash(command)})


if __name__ == "__main__":
    main()
