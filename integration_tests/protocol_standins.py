"""Stand-ins for LLM servers that cannot run here (NOT SGLang, NOT NeMo-RL's ProRL workers): each speaks one
protocol's documented wire format in front of the real vLLM server, which does the sampling.

- `sglang`: SGLang's native `POST /generate` (`input_ids`, `sampling_params` with `max_new_tokens`, `return_logprob`;
  answers `text`, `output_ids`, `meta_info.output_token_logprobs` as [logprob, id, null] and `finish_reason` as
  {type}, `{"type": "abort", ...}` for an aborted request), `GET /health`, `GET /get_model_info`, and its weight-update
  routes `POST /pause_generation {"mode": "abort"}`, `/continue_generation`, `/abort_request` (vLLM's `/pause`,
  `/resume` and `/abort_requests` behind them).
- `prorl`: ProRL Agent's token-level `POST /generate` (`prompt_ids`, `max_tokens`, `temperature`, `top_p`, `seed`;
  answers `response_ids` and `logprobs`); no health route, as NeMo-RL's server has none.

Each translates to vLLM's /v1/completions with the same token ids and records what vLLM sampled (`sampled`), so a
test can check that a trajectory holds exactly those ids and logprobs.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web


@dataclass
class StandIn:
    protocol: str
    url: str = ""
    sampled: list[tuple[list[int], list[int], list[float]]] = field(default_factory=list)  # (prompt, ids, logprobs)


@contextlib.asynccontextmanager
async def protocol_standin(protocol: str, vllm_url: str) -> AsyncIterator[StandIn]:
    standin = StandIn(protocol)
    async with aiohttp.ClientSession() as http:
        model = (await (await http.get(f"{vllm_url}/v1/models")).json())["data"][0]["id"]

        async def sample(prompt_ids: list[int], body: dict) -> dict:
            request = {
                "model": model,
                "prompt": prompt_ids,
                "logprobs": 1,
                "return_token_ids": True,
                "skip_special_tokens": False,
                **body,
            }
            async with http.post(f"{vllm_url}/v1/completions", json=request) as response:
                response.raise_for_status()
                choice = (await response.json())["choices"][0]
            standin.sampled.append((prompt_ids, choice["token_ids"], choice["logprobs"]["token_logprobs"]))
            return choice

        async def sglang_generate(request: web.Request) -> web.Response:
            body = await request.json()
            params = body["sampling_params"]
            translated = {"max_tokens": params.get("max_new_tokens", 128)}
            for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "sampling_seed")):
                if theirs in params:
                    translated[ours] = params[theirs]
            if "regex" in params:
                translated["structured_outputs"] = {"regex": params["regex"]}
            choice = await sample(body["input_ids"], translated)
            entries = [[lp, i, None] for lp, i in zip(choice["logprobs"]["token_logprobs"], choice["token_ids"])]
            reason = choice["finish_reason"]
            finish = {"type": reason} if reason in ("length", "abort") else {"type": "stop"}
            if reason == "abort":
                finish["message"] = "Aborted"
            meta = {"id": "standin", "finish_reason": finish, "output_token_logprobs": entries}
            return web.json_response({"text": choice["text"], "output_ids": choice["token_ids"], "meta_info": meta})

        async def prorl_generate(request: web.Request) -> web.Response:
            body = await request.json()
            # Every key indexed, as NeMo-RL's server does: a request without one is its 500.
            translated = {key: body[key] for key in ("max_tokens", "temperature", "top_p")}
            if body["seed"] is not None:
                translated["seed"] = body["seed"]
            choice = await sample(body["prompt_ids"], translated)
            return web.json_response(
                {"response_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}
            )

        async def forward(path: str, body: dict | None = None) -> web.Response:
            async with http.post(f"{vllm_url}{path}", json=body) as response:
                response.raise_for_status()
            return web.json_response({"message": "ok", "status": "ok"})

        async def sglang_pause(request: web.Request) -> web.Response:
            mode = (await request.json()).get("mode", "abort")
            if mode != "abort":
                return web.json_response({"error": f"this stand-in pauses in abort mode only, not {mode}"}, status=400)
            return await forward("/pause?mode=abort")

        async def sglang_continue(request: web.Request) -> web.Response:
            return await forward("/resume")

        async def sglang_abort(request: web.Request) -> web.Response:
            return await forward("/abort_requests", {})

        async def ok(request: web.Request) -> web.Response:
            return web.Response()

        async def model_info(request: web.Request) -> web.Response:
            return web.json_response({"model_path": model, "tokenizer_path": model, "is_generation": True})

        app = web.Application()
        if protocol == "sglang":
            app.router.add_routes(
                [
                    web.post("/generate", sglang_generate),
                    web.get("/health", ok),
                    web.get("/get_model_info", model_info),
                    web.post("/pause_generation", sglang_pause),
                    web.post("/continue_generation", sglang_continue),
                    web.post("/abort_request", sglang_abort),
                ]
            )
        else:
            app.router.add_routes([web.post("/generate", prorl_generate)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        standin.url = f"http://{host}:{port}"
        try:
            yield standin
        finally:
            await runner.cleanup()
