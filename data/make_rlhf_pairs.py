#!/usr/bin/env python3
"""Preference pairs that encode a known true reward, for the RLHF learning proof (docs/rlhf.md).

    .venv/bin/python data/make_rlhf_pairs.py    # writes data/rlhf-length-pairs.jsonl, data/rlhf-length-heldout.jsonl

The true reward is rl-tiny's own: `target_length` with target 12 words (1 - |words - 12| / 12, clipped at 0). The
responses are what the RL policy will produce at its start: samples of the project's tiny Qwen2 (`tiny:qwen2`, the
base of the SFT stage) on the rl-tiny prompts and a second, held-out prompt set, at temperature 1, up to 16 tokens,
as configs/rl-tiny.toml samples. Two samples of one prompt become a pair when their true rewards differ by at least
0.25: the one closer to 12 words is chosen. So the labels are a rule the reward model has to find in the text, as
a human rater's preferences would be, and the rule is known, so the RL stage can be checked against it.

Deterministic: seeded sampling on CPU in fp32 (torch.manual_seed per prompt), prompts in file order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model  # noqa: E402
from rollout_lib.reward.functions import RewardInput, target_length  # noqa: E402

HELD_OUT_PROMPTS = [
    "Describe a quiet morning.", "What do you like about trees?", "Write something about rain.",
    "Tell me about a city at night.", "Say a few words about music.", "What is a good breakfast?",
    "Describe the mountains.", "Write a line about friendship.",
]
SAMPLES_PER_PROMPT = {"train": 256, "heldout": 64}
MIN_GAP = 0.25


def true_reward(text: str) -> float:
    return target_length(RewardInput([], text), target=12, unit="words")


def samples(model, tokenizer, prompt: str, count: int, seed: int) -> list[str]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([ids] * count), attention_mask=torch.ones(count, len(ids), dtype=torch.long),
                         do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16,
                         pad_token_id=tokenizer.pad_token_id)
    return [tokenizer.decode(row[len(ids):], skip_special_tokens=True) for row in out]


def pairs_of(prompt: str, texts: list[str]) -> list[dict]:
    """Consecutive samples paired (0-1, 2-3, ...), kept when the true rewards differ by MIN_GAP or more."""
    rows = []
    for first, second in zip(texts[0::2], texts[1::2]):
        a, b = true_reward(first), true_reward(second)
        if abs(a - b) >= MIN_GAP:
            chosen, rejected = (first, second) if a > b else (second, first)
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def main() -> None:
    resolved = resolve_model("tiny:qwen2")
    tokenizer, model = load_tokenizer(resolved), load_causal_lm(resolved).eval()
    # A chat prompt (rl-tiny's last) is paired by its user message: a pair's prompt is one user turn.
    train_prompts = [row.get("prompt") or row["messages"][-1]["content"]
                     for row in map(json.loads, (ROOT / "data/rl-tiny-prompts.jsonl").open())]
    for split, prompts, path in (("train", train_prompts, "data/rlhf-length-pairs.jsonl"),
                                 ("heldout", HELD_OUT_PROMPTS, "data/rlhf-length-heldout.jsonl")):
        rows = []
        with torch.inference_mode():
            for index, prompt in enumerate(prompts):
                texts = samples(model, tokenizer, prompt, SAMPLES_PER_PROMPT[split], seed=1000 * index + len(split))
                rows.extend(pairs_of(prompt, texts))
        (ROOT / path).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        print(f"{path}: {len(rows)} pairs")
    (ROOT / "data/rlhf-heldout-prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": prompt}) + "\n" for prompt in HELD_OUT_PROMPTS))


if __name__ == "__main__":
    main()
