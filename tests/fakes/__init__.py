"""In-process stand-ins for what the rollout service talks to, for unit tests: an LLM server (`ScriptedLLM`), a
sandbox runtime (`SandboxStandIn`), a tokenizer (`CharChat`), and virtual time (`on_virtual_time`). None of
them is a model or a sandbox; each is named as a stand-in where it is used."""

from .chat import CharChat
from .clock import on_virtual_time, run_virtual
from .llm import Garbage, Reply, ScriptedLLM, bash_call, finish_call, tool_call
from .rigs import CHECK, EpisodeRig, Stack, episode_rig, llm_pool, rollout_stack, scripted_llms, shell_job
from .sandbox import SandboxStandIn
from .standin import HANG, Fail, Hang

__all__ = [
    "CHECK",
    "HANG",
    "CharChat",
    "EpisodeRig",
    "Fail",
    "Garbage",
    "Hang",
    "Reply",
    "SandboxStandIn",
    "ScriptedLLM",
    "Stack",
    "bash_call",
    "episode_rig",
    "finish_call",
    "llm_pool",
    "on_virtual_time",
    "rollout_stack",
    "run_virtual",
    "scripted_llms",
    "shell_job",
    "tool_call",
]
