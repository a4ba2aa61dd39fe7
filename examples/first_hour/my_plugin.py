"""My first plugin: a task of my own (`lines`) and a reward rule of my own (`turns`), on one class.

The task: init writes the instance's lines into notes.txt in the episode's sandbox; the agent is asked to write
how many lines it has into answer.txt; eval reads answer.txt through the runtime's file API and scores
`outcome` 1.0 when it holds the right number. The reward rule: -0.05 for each turn after the first.
"""

from prorl_adapter.hooks import hookimpl
from prorl_adapter.tasks import TaskConfigError, TaskHandler
from sandbox_runtime.client import SandboxAPIError


class LinesTask(TaskHandler):
    name = "lines"  # what JobRequest.task names

    def system_prompt(self, instance):
        return "You work in a Linux shell through the bash tool. Call one tool per turn."

    def user_prompt(self, instance):
        return "How many lines does notes.txt have? Write the number into answer.txt."

    async def init(self, env, instance):
        lines = instance.get("lines")
        if not isinstance(lines, list) or not all(isinstance(line, str) and "\n" not in line for line in lines):
            raise TaskConfigError("a lines instance needs 'lines', a list of one-line strings")  # the job fails in init
        await env.write_file("notes.txt", "".join(f"{line}\n" for line in lines))

    async def evaluate(self, env, instance, state):
        # By now every process the agent started is gone. The runtime reads the file itself: a link planted as
        # answer.txt is refused, not followed.
        try:
            answer = (await env.read_file("answer.txt")).decode(errors="replace")
        except SandboxAPIError as error:
            if error.status >= 500:
                raise  # the runtime failed, not the policy: the episode is filtered, not scored 0
            return {"outcome": 0.0}  # no answer.txt (or not a plain file)
        return {"outcome": 1.0 if answer.strip() == str(len(instance["lines"])) else 0.0}


class LinesPlugin:
    turn_penalty = 0.05

    @hookimpl
    def prorl_register_tasks(self):
        return [LinesTask()]

    @hookimpl
    def prorl_reward_components(self, trajectory):
        if trajectory.task != "lines":
            return None  # no opinion on other tasks' rewards
        extra_turns = max(0, trajectory.num_turns - 1)
        return {"turns": -self.turn_penalty * extra_turns if extra_turns else 0.0}
