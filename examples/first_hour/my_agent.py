"""My agent program: it asks the model once, then runs the bash commands the model called for, where it runs (in
the episode's sandbox). It knows nothing of RL: OPENAI_BASE_URL and OPENAI_API_KEY name the rollout service's
LLM gateway, which records every call in token space; PRORL_TASK_PROMPT is the task's question."""

import json
import os
import subprocess

from openai import OpenAI

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}

client = OpenAI()
messages = [{"role": "user", "content": os.environ["PRORL_TASK_PROMPT"]}]
reply = client.chat.completions.create(model="policy", messages=messages, tools=[BASH]).choices[0].message
for call in reply.tool_calls or []:
    command = json.loads(call.function.arguments)["command"]
    print(f"$ {command}", flush=True)
    subprocess.run(["bash", "-c", command], timeout=60, check=False)
