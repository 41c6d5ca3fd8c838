#!/usr/bin/env python3
"""SmolLM2's tool-call warm start (configs/sft-smollm2-tools.toml): demonstrations of the `calculate` tool on
products of a 2-digit and a 3-digit number, framed exactly as configs/rl-smollm2-tools.toml frames its episodes.

    python data/make_tool_sft.py   # writes data/sft-smollm2-tools.jsonl

Each row is TRL's SFT shape with tools: `tools` (the schema the RL env shows, made by the project's own toolbox from
the tool's signature and docstring) and `messages`: the RL config's system prompt, "What is A * B?", then

- CALL_RATE of the rows: an assistant turn that calls `calculate` with "A * B" (the RL driver's call id
  `call_1_0`), the tool's result (calculate's own output), and the answer "A * B = C." (the result copied);
- the others: an answer without a call that guesses, as the base model does ("A * B = G.", G a wrong product of
  the same length): imperfect on purpose, so that the warm start calls the tool often but not always and RL has
  something to learn.

The products are none of the RL prompts' (data/rl-tools-products-train.jsonl, -heldout.jsonl): the held-out rate
measures calls on products the warm start never saw. Deterministic: one seeded `random.Random`, no iteration over
sets; the system prompt and the tool are read from the RL config, so the two cannot drift apart.
"""

from __future__ import annotations

import json
import random
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from make_tool_products import product_rows  # noqa: E402

from rollout_lib.envs.tools import ToolSettings  # noqa: E402
from rollout_lib.envs.tools.toolbox import build_toolbox  # noqa: E402

RL_CONFIG = ROOT / "configs/rl-smollm2-tools.toml"
OUT = HERE / "sft-smollm2-tools.jsonl"
SEED, ROWS = 2, 256  # the products (make_tool_products.py: train 0, held-out 1)
CHOICE_SEED = 3  # which rows call, and the guesses
CALL_RATE = 0.75


def rl_env() -> dict:
    return tomllib.loads(RL_CONFIG.read_text())["algorithm"]["rl"]["envs"][0]


def wrong_product(rng: random.Random, right: int) -> int:
    """A guess as the base model makes one: the right number of digits, not the product."""
    while True:
        guess = rng.randint(10 ** (len(str(right)) - 1), 10 ** len(str(right)) - 1)
        if guess != right:
            return guess


def demonstration(rng: random.Random, system: str, tools: list[dict], toolbox, row: dict) -> dict:
    expr = row["prompt"].removeprefix("What is ").removesuffix("?")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": row["prompt"]}]
    if rng.random() < CALL_RATE:
        result = toolbox.tools["calculate"].function(expression=expr)
        assert result == row["answer"], (expr, result)
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1_0", "type": "function",
                 "function": {"name": "calculate", "arguments": {"expression": expr}}}]},
            {"role": "tool", "tool_call_id": "call_1_0", "name": "calculate", "content": result},
            {"role": "assistant", "content": f"{expr} = {result}."},
        ]
    else:
        messages.append({"role": "assistant", "content": f"{expr} = {wrong_product(rng, int(row['answer']))}."})
    return {"tools": tools, "messages": messages}


def main() -> None:
    env = rl_env()
    toolbox = build_toolbox([ToolSettings.model_validate(tool) for tool in env["tools"]])
    taken = frozenset(json.loads(line)["prompt"].removeprefix("What is ").removesuffix("?")
                      for name in ("rl-tools-products-train.jsonl", "rl-tools-products-heldout.jsonl")
                      for line in (HERE / name).read_text().splitlines())
    rng = random.Random(CHOICE_SEED)
    rows = [demonstration(rng, env["system_prompt"], toolbox.schemas, toolbox, row)
            for row in product_rows(SEED, ROWS, taken)]
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
