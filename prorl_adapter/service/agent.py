"""The multi-turn agent loop of one episode, in token space.

Each turn: the whole context (prompt ids + every id so far) goes to the pinned LLM server; the sampled ids
are appended with mask 1 and their logprobs; the turn's text is parsed for tool calls; the tools run in the
episode's sandbox; their results are appended as template ids with mask 0. The loop ends on `finish`, on a
turn with no tool call, at max turns, or when the next turn would not fit the context.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from server_kit.errors import ProrlError

from ..models import FinishReason, JobRequest, Resumption, SamplingParams, Segment, ToolCall, Turn
from ..tasks import EpisodeState, SandboxHandle, TaskHandler, Tool
from .actions import FORMATS, ActionFormat
from .chat import ChatTokenizer, text_size
from .llm import Generation, LLMPool, LLMUnavailable, Pin
from .weight_barrier import WeightBarrier

MAX_OBSERVATION_CHARS = 8000


@dataclass
class Episode:
    prompt_ids: list[int]
    actions: ActionFormat = FORMATS["hermes"]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: FinishReason = "max_turns"
    state: EpisodeState = field(default_factory=EpisodeState)
    segments: list[Segment] = field(default_factory=list)  # token sequences after the first (agent programs)
    prompt_messages: list[dict[str, Any]] = field(default_factory=list)  # what rendered prompt_ids (agent loop)
    prompt_tools: list[dict[str, Any]] | None = None
    generate_s: float = 0.0
    tools_s: float = 0.0

    @property
    def context_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.response_mask += [mask] * len(ids)
        self.response_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def clip(text: str, limit: int = MAX_OBSERVATION_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters omitted ...]\n{text[-half:]}"


@dataclass
class PolicyTurn:
    """A sampled turn whose tool calls have not run yet."""

    turn: Turn
    calls: list[ToolCall]
    errors: list[str]
    last_token: int | None


class PromptTooLong(ProrlError):
    """The task's prompt alone does not fit the episode's context: there is nothing to sample."""


# A turn aborted this many times is given up (LLMUnavailable): something aborts everything it sends.
MAX_RESUMPTIONS = 100


@dataclass
class SampledTurn:
    """One turn's generation, whole: its parts joined where it was interrupted and resumed."""

    generation: Generation
    policy_version: int  # the version that sampled its first token
    resumptions: list[Resumption]


async def sample(
    llm: LLMPool,
    chat: ChatTokenizer,
    prompt_ids: list[int],
    sampling: SamplingParams,
    pin: Pin,
    barrier: WeightBarrier,
) -> SampledTurn:
    """One turn from the pool, with its text and finish reason filled in whatever the server's protocol gave.

    Each request waits at the weight barrier while it is held. A request the server aborted (the barrier's abort
    mode, or anyone's abort) answers with the tokens sampled so far; the turn goes on from its prompt plus those
    tokens once the barrier lets it, with the rest of its token budget, and ends as a turn ends. Every sampled
    token is kept once, with the logprob and the version it was sampled with. Under a regex the rest cannot be
    asked for (the server would match the regex from its start again): the turn is sampled again whole."""
    ids: list[int] = []
    logprobs: list[float] = []
    resumptions: list[Resumption] = []
    first_version: int | None = None
    seconds = 0.0
    for _ in range(MAX_RESUMPTIONS + 1):
        rest = sampling
        if ids:  # the rest of the turn; a seeded one draws on (the same seed would replay the first part's draws)
            seed = sampling.seed + len(ids) if sampling.seed is not None else None
            rest = sampling.model_copy(update={"max_tokens": sampling.max_tokens - len(ids), "seed": seed})
        async with barrier.generating() as request:
            part = await llm.generate(prompt_ids + ids, rest, pin, request.progress)
        seconds += part.seconds
        if part.aborted and sampling.regex:
            continue  # nothing kept: the whole turn again
        # Versions by token: the request's own, and where a `keep` barrier froze it, the newer one after.
        for offset, version in request.versions(len(part.token_ids)) if part.token_ids else []:
            if ids or offset:
                resumptions.append(Resumption(offset=len(ids) + offset, policy_version=version))
            else:
                first_version = version
        ids += part.token_ids
        logprobs += part.logprobs
        done = (ids and ids[-1] == chat.eos_id) or len(ids) >= sampling.max_tokens
        if not part.aborted or done:
            break
    else:
        raise LLMUnavailable(f"the turn was aborted {MAX_RESUMPTIONS + 1} times in a row by the LLM server")
    closed = bool(ids) and ids[-1] == chat.eos_id
    generation = part
    if part.aborted or len(ids) != len(part.token_ids):  # joined: the text is decoded from every part's ids
        finish = None if part.aborted else part.finish_reason
        if part.aborted and closed:
            finish = "stop"  # it ended as it would have, just as the abort came
        generation = replace(part, token_ids=ids, logprobs=logprobs, text=None, finish_reason=finish, aborted=False)
    generation.seconds = seconds
    # The text is the ids' own where the protocol returns ids only, or where a stop string may have ended the
    # turn: an OpenAI server trims the stop string from its text while the ids hold it (a closing fence as a stop
    # would leave the block unclosed). The text of a turn ends before its eos.
    if generation.text is None or (sampling.stop and not closed):
        generation.text = await chat.off_loop(chat.decode, ids[:-1] if closed else ids, size=len(ids))
    if generation.finish_reason is None and not closed and len(ids) >= sampling.max_tokens:
        generation.finish_reason = "length"  # a protocol that says no reason (ProRL's): cut at its token limit
    return SampledTurn(generation, request.latest if first_version is None else first_version, resumptions)


async def start_episode(
    request: JobRequest, handler: TaskHandler, chat: ChatTokenizer
) -> tuple[Episode, dict[str, Tool]]:
    """The episode's prompt (system prompt with the task's tools, as its action format offers them, then the
    task) and its tools."""
    instance = request.instance
    tools = {tool.name: tool for tool in handler.tools(instance)}
    actions = FORMATS[request.action_format or handler.action_format]
    system, schemas = actions.offer(chat, handler.system_prompt(instance), list(tools.values()))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": handler.user_prompt(instance)}]
    prompt_ids = await chat.off_loop(chat.prompt_ids, messages, schemas, size=text_size(messages, schemas))
    if len(prompt_ids) >= request.max_context_tokens:
        raise PromptTooLong(
            f"the prompt is {len(prompt_ids)} tokens, max_context_tokens is {request.max_context_tokens}"
        )
    episode = Episode(prompt_ids=prompt_ids, actions=actions, prompt_messages=messages, prompt_tools=schemas)
    return episode, tools


async def policy_turn(
    episode: Episode,
    request: JobRequest,
    llm: LLMPool,
    chat: ChatTokenizer,
    pin: Pin,
    barrier: WeightBarrier,
    index: int,
    tools: dict[str, Tool],
) -> PolicyTurn | None:
    """Sample the next turn and record it; None when the episode ends here (context full, or no tool call)."""
    room = request.max_context_tokens - episode.context_length
    if room <= 0:
        episode.finish_reason = "max_context"
        return None
    sampling = request.sampling.model_copy(update={"max_tokens": min(request.sampling.max_tokens, room)})
    sampled = await sample(llm, chat, episode.prompt_ids + episode.response_ids, sampling, pin, barrier)
    generation = sampled.generation
    start = len(episode.response_ids)
    episode.append(generation.token_ids, 1, generation.logprobs)
    episode.generate_s += generation.seconds
    episode.state.response_tokens += len(generation.token_ids)
    parsed = episode.actions.parse(generation.text, tools)
    turn = Turn(
        index=index,
        policy_version=sampled.policy_version,
        resumptions=sampled.resumptions,
        llm_server=generation.server,
        response_start=start,
        response_tokens=len(generation.token_ids),
        finish_reason=generation.finish_reason,
        text=generation.text,
        tool_calls=parsed.calls,
        tool_call_errors=parsed.errors,
        generate_s=generation.seconds,
    )
    episode.turns.append(turn)
    episode.state.turns = len(episode.turns)
    episode.state.malformed_calls += len(parsed.errors)
    if not parsed.calls and not parsed.errors:
        episode.finish_reason = "no_tool_call"
        return None
    return PolicyTurn(turn, parsed.calls, parsed.errors, generation.token_ids[-1] if generation.token_ids else None)


async def tool_turn(
    episode: Episode,
    pending: PolicyTurn,
    tools: dict[str, Tool],
    env: SandboxHandle,
    chat: ChatTokenizer,
    limit: int,
    last: bool = False,
) -> bool:
    """Run the turn's tool calls and append their results; False when the episode ends here (finish, or the
    results would not fit the context of `limit` tokens). On the `last` turn the tools run (eval sees what they
    did) but their results are not appended: no policy turn reads them, so the trajectory ends with the policy's
    tokens."""
    started = time.perf_counter()
    results, finished = await _run_tools(pending.calls, tools, env, episode.state)
    results += [f"error: {error}" for error in pending.errors]
    turn = pending.turn
    turn.tools_s = time.perf_counter() - started
    episode.tools_s += turn.tools_s
    if finished:
        episode.finish_reason = "agent_timeout" if episode.state.time_up else "finish"
        return False
    turn.observation = "\n".join(results)
    if last:
        return False
    closed = pending.last_token == chat.eos_id  # else the template's eos is added, as a token nobody sampled
    messages = [{"role": "tool", "content": r} for r in results]
    observation_ids = await chat.off_loop(chat.tool_turn_ids, messages, closed, size=text_size(messages))
    if episode.context_length + len(observation_ids) >= limit:
        episode.finish_reason = "max_context"
        return False
    turn.observation_tokens = len(observation_ids)
    turn.tool_results = results
    episode.append(observation_ids, 0)
    return True


async def run_episode(
    request: JobRequest,
    handler: TaskHandler,
    env: SandboxHandle,
    chat: ChatTokenizer,
    llm: LLMPool,
    barrier: WeightBarrier,
    started: Callable[[Episode], None] | None = None,
) -> Episode:
    """The episode; `started` is given it as soon as it has a prompt, so that what a stopped episode had made is
    known (the pipeline keeps it for a trajectory whose time budget ran out)."""
    episode, tools = await start_episode(request, handler, chat)
    if started is not None:
        started(episode)
    pin = Pin()
    for index in range(request.max_turns):
        pending = await policy_turn(episode, request, llm, chat, pin, barrier, index, tools)
        last = index == request.max_turns - 1
        if pending is None or not await tool_turn(episode, pending, tools, env, chat, request.max_context_tokens, last):
            break
    return episode


async def _run_tools(
    calls: list, tools: dict[str, Tool], env: SandboxHandle, state: EpisodeState
) -> tuple[list[str], bool]:
    results: list[str] = []
    for call in calls:
        tool = tools.get(call.name)
        if tool is None:
            results.append(f"error: unknown tool {call.name!r}; available: {', '.join(tools)}")
        elif tool.run is None:  # finish
            answer = call.arguments.get("answer")
            state.answer = answer if isinstance(answer, str) else json.dumps(answer)
            return results, True
        else:
            results.append(clip(await tool.run(env, call.arguments, state)))
            if state.time_up:  # the task's time for the agent is over: no more turns
                return results, True
    return results, False
