"""An RL step's samples as a tracker table: a bounded number of rows, the ones worth reading first.

The failed ones (a reward missing) first, then the worst and the best in turns, each once: a tracker shows what
went wrong and what went right in a step, not the first N rows of the table. Read from the step's stored tables
(runlog/samples.py), on the tracker's thread.
"""

from __future__ import annotations

import json

from rollout_lib.runlog.samples import shown_first, step_rows
from rollout_lib.runlog.step_tables import read_step_tables
from rollout_lib.store import ObjectStore

# The table's name in W&B and trackio. Not "samples": RL steps report a metric of that name (the step's sample
# count), which the table would overwrite.
TABLE_KEY = "sample_table"
COLUMNS = ["sample_id", "env", "prompt", "completion", "reward", "rewards", "reward_error", "advantage",
           "prompt_tokens", "completion_tokens", "model_turns", "tool_calls", "sampled_from"]


def step_sample_table(store: ObjectStore, run_name: str, step: int, limit: int) -> tuple[list[str], list[list]] | None:
    """(columns, rows) of `step`'s samples for a tracker, or None for a step without stored samples (RM, SFT)."""
    if limit <= 0 or read_step_tables(store, run_name, step) is None:
        return None
    rows = shown_first(step_rows(store, run_name, step), limit)
    return COLUMNS, [[_cell(_prompt(row["prompt"]) if name == "prompt" else row[name]) for name in COLUMNS]
                     for row in rows]


def _prompt(messages: list[dict] | None) -> str | None:
    """The prompt as a tracker shows it: the last user message (the chat template's system text is noise)."""
    users = [message["content"] for message in messages or () if message.get("role") == "user"]
    return users[-1] if users else None


def _cell(value):
    """Trackers' tables hold scalars and text: a prompt's messages or a dict of rewards as JSON."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return value
