"""An agent as a program: `interaction = { type = "agent", command = ["python", "my_agent.py", "--flag"] }`.

For agents not written in Python, or kept out of the trainer's process (how ART and Harbor-style harnesses run
theirs). Each episode starts the command once, as a list of arguments (never through a shell), in a process group
of its own, with
- `OPENAI_BASE_URL`: the episode's OpenAI-compatible endpoint (agent_server.py), `OPENAI_API_KEY` (any value is
  accepted; set so that OpenAI clients start without one of the user's) and `ROLLOUT_MODEL` (the model name to send);
- on stdin, one JSON object: `{"task": {example_id, messages, answer, info}, "kwargs": {...}}` (the interaction's
  `kwargs`), then end of file.
Its last non-empty line on stdout is its result, JSON: a number (the reward), `null` (leave scoring to the env's
reward functions) or `{"reward": number or null}`. Anything else it prints before that line is ignored.

A program that exits with a non-zero code, prints no result, or runs past `timeout_s` (its whole process group is
then killed) fails its episode like a raising agent function: counted, reward missing, the end of its stderr in
the reason. A step's programs all run at once (they mostly wait on the endpoint, which samples one request at a
time); their number is the step's episodes, prompts_per_step x group_size.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

from rollout_lib.envs.agent_server import MODEL_NAME

STDERR_TAIL = 400  # characters of a failed program's stderr quoted in its episode's reason


class AgentProgramError(RuntimeError):
    """The program failed its episode: its exit code or its output, and the end of its stderr."""


class AgentProgram:
    """`command` as an agent: `await AgentProgram(command).run(base_url, task, **kwargs)` is one episode."""

    def __init__(self, command: list[str]):
        self.command = list(command)

    async def run(self, base_url: str, task: dict, **kwargs) -> float | None:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "rollout", "ROLLOUT_MODEL": MODEL_NAME}
        process = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        try:
            stdout, stderr = await process.communicate(json.dumps({"task": task, "kwargs": kwargs}).encode())
        except BaseException:  # cancelled at the episode's timeout (or the step ends): nothing of it outlives it
            _kill_group(process)  # before it is reaped, so its group id cannot name another process's group
            await process.wait()
            raise
        tail = stderr.decode(errors="replace").strip()[-STDERR_TAIL:]
        if process.returncode != 0:
            raise AgentProgramError(f"exited with code {process.returncode}" + (f"; stderr: {tail}" if tail else ""))
        return _result(stdout.decode(errors="replace"), tail)


def _result(stdout: str, stderr_tail: str) -> float | None:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise AgentProgramError("printed no result (its last line on stdout: a number, null or {\"reward\": ...})"
                                + (f"; stderr: {stderr_tail}" if stderr_tail else ""))
    try:
        result = json.loads(lines[-1])
    except ValueError:
        result = lines[-1]
    if isinstance(result, dict) and set(result) == {"reward"}:
        result = result["reward"]
    if result is None or (isinstance(result, (int, float)) and not isinstance(result, bool)):
        return result
    raise AgentProgramError(f"its last line on stdout is not a result: {lines[-1][:200]!r} (a number, null or "
                            "{\"reward\": ...})")


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the program and every process it started in its group (start_new_session made it the leader)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group has ended
