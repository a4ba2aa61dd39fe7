"""An agent harness for the gateway tests (NOT a real agent): it runs inside the episode's sandbox, as a team's
own harness would, on the official `openai` client or on `litellm`, and does exactly what a test asks through
its environment. It knows the gateway only as OPENAI_BASE_URL and OPENAI_API_KEY.

    HARNESS_CLIENT=openai|litellm   HARNESS_STREAM=0|1   HARNESS_STEPS=N
    HARNESS_PROTOCOL=chat|responses|anthropic
                                    the API it speaks (default chat): OpenAI's Responses API through the `openai`
                                    client (streamed: continued by previous_response_id; else its whole history
                                    sent back) or Anthropic's Messages API through the `anthropic` client, which
                                    knows the gateway as ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY
    HARNESS_EDIT=1                  send the first answer back edited (a harness that rewrites its history)
    HARNESS_FOREIGN_KEY=KEY         first try a call with another episode's key and print what happened
    HARNESS_PROBE_PORT=PORT         print whether 127.0.0.1:PORT (a host port, not forwarded) can be reached
    HARNESS_CONTINUE=1              after an answer without tool calls, say "Go on." instead of stopping
    HARNESS_PROBE_API=1             print what the service's own API answers through the gateway's address

Each step prints one JSON line: {"step", "tool_calls", "content", "finish_reason"}.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.error
import urllib.request

# Empty where the tests import this file for its TOOLS (the sandbox's environment always has both).
BASE, KEY = os.environ.get("OPENAI_BASE_URL", ""), os.environ.get("OPENAI_API_KEY", "")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command in the sandbox.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


def ask(messages: list[dict], key: str = KEY) -> dict:
    """One chat call; the answer as a message dict (the streamed chunks put together) plus its finish reason."""
    stream = os.environ.get("HARNESS_STREAM") == "1"
    if os.environ.get("HARNESS_CLIENT") == "litellm":
        import litellm

        answer = litellm.completion(
            model="openai/policy", api_base=BASE, api_key=key, messages=messages, tools=TOOLS, stream=stream
        )
    else:
        import openai

        client = openai.OpenAI(base_url=BASE.replace(KEY, key), api_key=key, max_retries=0)
        answer = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=stream)
    if not stream:
        choice = answer.choices[0]
        message = choice.message.model_dump(exclude_none=True)
        return {"message": message, "finish_reason": choice.finish_reason}
    content, calls, finish = "", {}, None
    for chunk in answer:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(
                call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            slot["id"] = call.id or slot["id"]
            slot["function"]["name"] += call.function.name or ""
            slot["function"]["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "finish_reason": finish}


CONTINUE = os.environ.get("HARNESS_CONTINUE") == "1"
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (tool["function"] for tool in TOOLS)
]


def responses_episode(system: str, prompt: str, steps: int) -> None:
    """Tool use through the Responses API: each step's function calls run and their outputs sent back."""
    import openai

    client = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0)
    stream = os.environ.get("HARNESS_STREAM") == "1"
    history: list = [{"role": "user", "content": prompt}]
    new, previous = list(history), None
    for step in range(steps):
        common = {"model": "policy", "instructions": system, "tools": RESPONSES_TOOLS}
        if stream:  # the SDK's stream helper assembles the events; the call continues the previous response
            with client.responses.stream(input=new, previous_response_id=previous, **common) as events:
                answer = events.get_final_response()
        else:
            answer = client.responses.create(input=history, store=False, **common)
        output = [item.model_dump(exclude_none=True) for item in answer.output]
        calls = [item for item in output if item["type"] == "function_call"]
        print_step(step, answer.output_text or None, calls, answer.status)
        outputs = [
            {"type": "function_call_output", "call_id": c["call_id"], "output": run_tool({"function": c})}
            for c in calls
        ]
        go_on = [] if calls or not CONTINUE else [{"role": "user", "content": "Go on."}]
        history += output + outputs + go_on
        new, previous = outputs + go_on, answer.id
        if not calls and not CONTINUE:
            break


def anthropic_episode(system: str, prompt: str, steps: int) -> None:
    """Tool use through Anthropic's Messages API, as a Claude-style harness does it."""
    import anthropic

    client = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY
    messages: list = [{"role": "user", "content": prompt}]
    for step in range(steps):
        call = {"model": "policy", "max_tokens": 256, "system": system, "messages": messages, "tools": ANTHROPIC_TOOLS}
        if os.environ.get("HARNESS_STREAM") == "1":
            with client.messages.stream(**call) as events:
                answer = events.get_final_message()
        else:
            answer = client.messages.create(**call)
        blocks = [block.model_dump(exclude_none=True) for block in answer.content]
        uses = [b for b in blocks if b["type"] == "tool_use"]
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        calls = [{"name": u["name"], "arguments": json.dumps(u["input"])} for u in uses]
        print_step(step, text or None, calls, answer.stop_reason)
        messages.append({"role": "assistant", "content": blocks})
        if not uses and CONTINUE:
            messages.append({"role": "user", "content": "Go on."})
            continue
        if not uses:
            break
        results = [
            {"type": "tool_result", "tool_use_id": u["id"], "content": run_tool({"function": c})}
            for u, c in zip(uses, calls)
        ]
        messages.append({"role": "user", "content": results})


def print_step(step: int, content: str | None, calls: list[dict], finish: str | None) -> None:
    """One step in the chat harness's form: tool calls as {"function": {"name", "arguments"}}."""
    functions = [{"function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    print(json.dumps({"step": step, "tool_calls": functions, "content": content, "finish_reason": finish}), flush=True)


def run_tool(call: dict) -> str:
    command = json.loads(call["function"]["arguments"]).get("command", "")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
    return (done.stdout + done.stderr)[-2000:] + f"[exit {done.returncode}]"


def main() -> None:
    if os.environ.get("HARNESS_PROBE_PORT"):
        with socket.socket() as s:
            s.settimeout(3)
            reached = s.connect_ex(("127.0.0.1", int(os.environ["HARNESS_PROBE_PORT"]))) == 0
        print(json.dumps({"probe": "reachable" if reached else "unreachable"}), flush=True)
    if os.environ.get("HARNESS_PROBE_API"):  # what a policy's code would try: the trainer-facing API
        origin = BASE.split("/gateway/")[0]
        answers = {}
        for method, path in (("GET", "/v1/status"), ("PUT", "/v1/policy-version"), ("POST", "/v1/batches")):
            request = urllib.request.Request(origin + path, data=b"{}" if method != "GET" else None, method=method)
            try:
                answers[path] = urllib.request.urlopen(request, timeout=10).status
            except urllib.error.HTTPError as exc:
                answers[path] = exc.code
        print(json.dumps({"api": answers}), flush=True)
    if os.environ.get("HARNESS_FOREIGN_KEY"):
        try:
            ask([{"role": "user", "content": "hi"}], key=os.environ["HARNESS_FOREIGN_KEY"])
            print(json.dumps({"foreign": "accepted"}), flush=True)
        except Exception as exc:  # the client's own error type: what a harness would see
            print(json.dumps({"foreign": getattr(exc, "status_code", str(exc))}), flush=True)
    system, prompt = "You work in a Linux sandbox.", os.environ.get("PRORL_TASK_PROMPT", "")
    steps = int(os.environ.get("HARNESS_STEPS", "2"))
    protocol = os.environ.get("HARNESS_PROTOCOL", "chat")
    if protocol != "chat":
        (responses_episode if protocol == "responses" else anthropic_episode)(system, prompt, steps)
        return
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    for step in range(steps):
        answer = ask(messages)
        message = answer["message"]
        calls = message.get("tool_calls") or []
        print(json.dumps({"step": step, "tool_calls": calls, "content": message.get("content"), **answer}), flush=True)
        if step == 0 and os.environ.get("HARNESS_EDIT") == "1":
            message = {"role": "assistant", "content": "I will look around first."}  # the history, rewritten
            calls = []
            messages += [message, {"role": "user", "content": "Go on."}]
            continue
        messages.append(message)
        if not calls and CONTINUE:
            messages.append({"role": "user", "content": "Go on."})
        elif not calls:
            break
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": run_tool(c)} for c in calls]


if __name__ == "__main__":
    main()
