"""OpenAI-format tool calls for multi-turn envs: an env's `tools` (settings.py), the functions and their JSON
schemas (toolbox.py), parsers of the calls a model writes, one per template family (parsers/), and running one
call with a time limit (executor.py). The `tools` interaction (envs/tool_calls.py) puts them together; the
calculator tool is calculate.py."""

from rollout_lib.envs.tools.settings import FunctionSchema, ToolSettings
from rollout_lib.envs.tools.toolbox import Tool, Toolbox, ToolSetupError, build_toolbox

__all__ = ["FunctionSchema", "Tool", "ToolSettings", "ToolSetupError", "Toolbox", "build_toolbox"]
