#!/usr/bin/env python3
"""The teacher's SFT data for the distillation configs: every rl-tiny prompt answered with one fixed text.

    python data/make_sft_teacher.py   # writes data/sft-teacher-tiny.jsonl from data/rl-tiny-prompts.jsonl

`rollout train sft --config configs/sft-teacher-tiny.toml` trains the tiny model on it (the teacher of
configs/rl-opd.toml and configs/rl-sft-distill.toml, as tests/test_distillation.py does). The answer has 12 words,
so the toy env's reward (target_length, 12 words) scores it 1.0: a teacher that is better at the task than the
random student. A prompt row becomes {"prompt", "completion"}; a chat row gets the answer as its assistant turn.
Deterministic: rows in the prompts' order, no randomness.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEACHER_TEXT = "the sea is calm and the sky is blue and the sun"


def teacher_rows(prompts_path: Path) -> list[dict]:
    rows = []
    for line in prompts_path.read_text().splitlines():
        prompt = json.loads(line)
        if "messages" in prompt:
            rows.append({"messages": [*prompt["messages"], {"role": "assistant", "content": TEACHER_TEXT}]})
        else:
            rows.append({"prompt": prompt["prompt"], "completion": TEACHER_TEXT})
    return rows


def main() -> None:
    rows = teacher_rows(HERE / "rl-tiny-prompts.jsonl")
    (HERE / "sft-teacher-tiny.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
