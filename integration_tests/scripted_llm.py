"""A scripted LLM stand-in (NOT a model): an OpenAI-compatible /v1/completions server whose every answer is
chosen in advance, for tests that need a policy to do exactly one thing, such as a reward hack.

The user prompt of an episode carries `[script:NAME]`; turn N of that episode (counted from the assistant
turns already in the prompt) answers with the script's Nth text, tokenised with the served model's own
tokenizer and closed by its end-of-turn token, as a real server's sampled ids would be. Past the script's end
it answers with a call of `finish`.

`--delay-s S` holds every answer S seconds first (a server slow to generate, or one cut off mid-answer); GET /stats
says how many answers are being held and how many were given.

    python -m integration_tests.scripted_llm --listen-fd FD --tokenizer DIR --scripts scripts.json [--delay-s S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path

from aiohttp import web
from transformers import AutoTokenizer

from prorl_adapter.dev import localstack
from server_kit.webapp import inherited_socket

SCRIPT = re.compile(r"\[script:([A-Za-z0-9_-]+)\]")
FINISH = '<tool_call>{"name": "finish", "arguments": {"answer": "done"}}</tool_call>'


def bash_call(command: str) -> str:
    return "<tool_call>" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "</tool_call>"


def create_app(tokenizer_path: str, scripts: dict[str, list[str]], delay_s: float = 0.0) -> web.Application:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stats = {"in_flight": 0, "answered": 0}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "scripted"}]})

    async def stats_view(request: web.Request) -> web.Response:
        return web.json_response(stats)

    async def completions(request: web.Request) -> web.Response:
        stats["in_flight"] += 1
        try:
            body = await request.json()
            await asyncio.sleep(delay_s)
            answer = complete(body)
        finally:
            stats["in_flight"] -= 1
        stats["answered"] += 1
        return answer

    def complete(body: dict) -> web.Response:
        prompt = tokenizer.decode(body["prompt"])
        found = SCRIPT.search(prompt)
        script = scripts.get(found.group(1), []) if found else []
        turn = prompt.count("<|im_start|>assistant") - 1
        text = script[turn] if 0 <= turn < len(script) else FINISH
        ids = [*tokenizer.encode(text, add_special_tokens=False), end_of_turn]
        choice = {"text": text, "token_ids": ids, "logprobs": {"token_logprobs": [0.0] * len(ids)}}
        return web.json_response({"choices": [{**choice, "finish_reason": "stop"}]})

    app = web.Application()
    app.router.add_routes(
        [web.get("/v1/models", models), web.get("/stats", stats_view), web.post("/v1/completions", completions)]
    )
    return app


def command(scripts: dict[str, list[str]], workdir: Path, delay_s: float = 0.0) -> list[str]:
    """The stand-in's command line (on the socket "{listen_fd}" stands for), its scripts written to `workdir`."""
    localstack.build_tiny_model()
    path = workdir / "scripts.json"
    path.write_text(json.dumps(scripts))
    argv = [sys.executable, "-m", "integration_tests.scripted_llm", "--listen-fd", "{listen_fd}"]
    return [*argv, "--tokenizer", str(localstack.TINY_MODEL), "--scripts", str(path), "--delay-s", str(delay_s)]


def start(scripts: dict[str, list[str]], workdir: Path, delay_s: float = 0.0) -> localstack.Service:
    """Start the stand-in as a process of its own, serving `scripts` with the tiny model's tokenizer."""
    return localstack.start_service("scripted LLM stand-in", command(scripts, workdir, delay_s), "/v1/models", 60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen-fd", type=int, required=True, help="the listening socket start() hands it")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--scripts", required=True, help="JSON file: {name: [turn text, ...]}")
    parser.add_argument("--delay-s", type=float, default=0.0, help="seconds every answer is held first")
    args = parser.parse_args()
    with open(args.scripts) as f:
        scripts = json.load(f)
    app = create_app(args.tokenizer, scripts, args.delay_s)
    web.run_app(app, sock=inherited_socket(args.listen_fd), print=None)


if __name__ == "__main__":
    main()
