"""An env's PROMPTS from its verifiers environment's dataset (`source = { type = "verifiers" }`).

Each dataset row, as the environment formats it (its `prompt` messages, built from `question` with its system
prompt and few-shot examples, and the `example_id` it adds), becomes one PROMPTS row: the messages, the answer as
text, and in `info` the row itself without its prompt (`{"verifiers": {answer, info, task, example_id, ...}}`),
from which each episode gives the environment its input back (verifiers_env.verifiers_row). Rollout's own draw
picks a step's prompts from this table, seeded by content, as for any source.
"""

from __future__ import annotations

import json

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.data import DataError
from rollout_lib.envs.verifiers_env import load_verifiers_environment


def verifiers_prompts(env, where: str) -> pa.Table:
    """The PROMPTS of `env` (config.rl.EnvSettings with a verifiers interaction); `where`: its source's locator."""
    settings = env.interaction
    if settings is None or settings.type != "verifiers":
        raise DataError(f'{where}: type = "verifiers" reads the dataset of the env\'s verifiers environment: set '
                        'interaction = { type = "verifiers", env_id = "..." }')
    try:
        environment = load_verifiers_environment(settings)
        dataset = environment.get_eval_dataset() if env.source.split == "eval" else environment.get_dataset()
    except Exception as exc:  # noqa: BLE001 - the user's module and its load_environment may raise anything
        raise DataError(f"{where}: verifiers environment {settings.env_id!r} could not be loaded: "
                        f"{type(exc).__name__}: {exc}") from exc
    rows: dict[str, list] = {name: [] for name in wire.PROMPTS.names}
    seen: set[str] = set()
    for index, row in enumerate(dataset):
        located = f"{where}: verifiers environment {settings.env_id!r}, dataset row {index}"
        example_id = f"{env.name}/{row.get('example_id', index)}"
        if example_id in seen:
            raise DataError(f"{located}: example_id {row.get('example_id')!r} repeats")
        seen.add(example_id)
        rows["example_id"].append(example_id)
        rows["env"].append(env.name)
        rows["messages"].append(_messages(row.get("prompt"), env.system_prompt, located))
        answer = row.get("answer")
        rows["answer"].append(None if answer is None else answer if isinstance(answer, str) else json.dumps(answer))
        kept = {key: value for key, value in row.items() if key != "prompt"}
        try:
            rows["info"].append(json.dumps({"verifiers": kept}, sort_keys=True))
        except TypeError as exc:
            raise DataError(f"{located}: its columns are not JSON values ({exc})") from None
        rows["source_line"].append(None)
    if not rows["example_id"]:
        raise DataError(f"{where}: verifiers environment {settings.env_id!r} has an empty "
                        f"{'eval ' if env.source.split == 'eval' else ''}dataset")
    return pa.Table.from_pydict(rows, schema=wire.PROMPTS)


def _messages(prompt, system_prompt: str | None, located: str) -> list[dict]:
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{located}: its prompt is {type(prompt).__name__}, not a list of chat messages (rollout "
                        "runs chat environments; completion-style prompts are not supported)")
    messages = []
    for message in prompt:
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise DataError(f"{located}: a prompt message is {{role, content}} with text content, got {message!r}")
        messages.append({"role": message["role"], "content": message["content"]})
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages
