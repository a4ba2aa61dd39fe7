"""The run stage of an episode driven by an agent program of the user's own (JobRequest.agent).

The program runs in the episode's sandbox, in the agent's shell session, with the gateway's base URL and the
episode's key in its environment (the sandbox reaches the gateway through a forward made at init, and nothing
else). Its own tools run in the sandbox because it does. When it exits (or runs out of the job's time and is
stopped) the key is refused, and the calls it made become the trajectory's segments and turns
(token_history.py). A program that made no call produced nothing to train on: the run fails, with its exit
code and the end of its output, so a harness that cannot start is seen at once. A program whose call went
unanswered for an LLM outage (every server down past `--llm-outage-wait-s`) ran without its policy: the run
fails as the outage's (`JobError.outage`), as a built-in agent loop's turn would, and decoupled mode runs it again
without counting it.
"""

from __future__ import annotations

import shlex
import time

from server_kit.errors import ProrlError

from ..models import JobRequest
from ..tasks import SandboxHandle, TaskHandler
from .agent import Episode, clip
from .gateway import REFUSED_ARTIFACT, Gateway

STOP_MARGIN_S = 3.0  # the runtime's interrupt and kill graces, so the program is stopped before the stage is
MAX_PROGRAM_S = 3600.0  # the runtime's default longest command (its --max-timeout)
# Time kept from the job's budget for eval: a program that runs out the clock is stopped and graded like any
# other, never left without time to grade (a timed-out eval would filter the episode: a stall would escape a
# bad score).
EVAL_RESERVE_S = 120.0


def program_timeout(budget_s: float) -> float:
    """How long the program may run: the budget less the eval reserve (at most half of what is left)."""
    reserve = min(EVAL_RESERVE_S, budget_s / 2)
    return min(max(budget_s - reserve - STOP_MARGIN_S, 1.0), MAX_PROGRAM_S)


OUTPUT_ARTIFACT_CHARS = 8000


class ProgramFailed(ProrlError):
    """The program made no LLM call, or ran into an LLM outage (`outage`: not the policy's failure)."""

    def __init__(self, message: str, outage: bool = False) -> None:
        super().__init__(message)
        self.outage = outage


def program_command(command: str, env: dict[str, str]) -> str:
    """`command` with `env` exported, in a subshell so nothing of it stays in the session's shell."""
    exports = "".join(f"export {name}={shlex.quote(value)}; " for name, value in env.items())
    return f"( {exports}{command}\n)"


async def run_program(
    job_id: str, request: JobRequest, handler: TaskHandler, env: SandboxHandle, gateway: Gateway, budget_s: float
) -> Episode:
    agent = request.agent
    time_s = program_timeout(budget_s)
    episode = gateway.open(job_id, request, time_s + STOP_MARGIN_S)
    try:
        variables = {
            **agent.env,
            "OPENAI_BASE_URL": episode.base_url(),
            "OPENAI_API_KEY": episode.key,
            # Anthropic's SDK (and Claude Code) send the key as x-api-key to this base URL, adding /v1/messages
            "ANTHROPIC_BASE_URL": episode.anthropic_base_url(),
            "ANTHROPIC_API_KEY": episode.key,
            "PRORL_TASK_PROMPT": handler.user_prompt(request.instance),
        }
        started = time.perf_counter()
        result = await env.exec(program_command(agent.command, variables), timeout=time_s)
    finally:
        gateway.close(episode)
    elapsed = time.perf_counter() - started
    output = clip(result.output, OUTPUT_ARTIFACT_CHARS)
    if episode.outage is not None:  # what it did without answers is no measure of the policy: the outage's
        raise ProgramFailed(f"the agent program's LLM calls met an outage: {episode.outage}", outage=True)
    if not episode.log.calls:
        raise ProgramFailed(
            f"the agent program made no LLM call (status {result.status}, exit code {result.exit_code}): "
            f"{output[-2000:]}"
        )
    segments, turns = episode.log.segments()
    first, more = segments[0], segments[1:]
    run = Episode(
        **dict(first),  # the first segment's ids, mask and logprobs are the episode's own
        turns=turns,
        finish_reason="agent_timeout" if result.status == "timeout" else "agent_exit",
        segments=more,
        generate_s=sum(t.generate_s for t in turns),
    )
    run.tools_s = max(elapsed - run.generate_s, 0.0)  # the program's own time: its tools and its thinking
    run.state.turns = len(turns)
    run.state.time_up, run.state.time_limit_s = result.status == "timeout", time_s
    run.state.response_tokens = sum(t.response_tokens for t in turns)
    run.state.artifacts.update({"agent_output": output, "agent_exit_code": str(result.exit_code)})
    if episode.refused:
        run.state.artifacts[REFUSED_ARTIFACT] = str(episode.refused)
    return run
