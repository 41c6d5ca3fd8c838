"""Loaders into Arrow tables: JSONL files (a malformed row is an error `path:lineno: reason`) and parquet / Arrow /
`save_to_disk` tables (sources.py; errors name the setting's locator and the path)."""

from rollout_lib.data.jsonl import DataError
from rollout_lib.data.pairs import load_pairs, load_responses, read_pairs
from rollout_lib.data.prompts import generate_reasoning_gym_prompts, load_env_prompts, load_jsonl_prompts
from rollout_lib.data.sft import load_examples, read_examples

__all__ = ["DataError", "generate_reasoning_gym_prompts", "load_env_prompts", "load_examples", "load_jsonl_prompts",
           "load_pairs", "load_responses", "read_examples", "read_pairs"]
