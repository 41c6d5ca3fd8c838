"""JSONL loaders into Arrow tables; malformed rows are errors `path:lineno: reason`."""

from rollout_lib.data.jsonl import DataError
from rollout_lib.data.pairs import load_pairs, load_responses
from rollout_lib.data.prompts import generate_reasoning_gym_prompts, load_env_prompts, load_jsonl_prompts
from rollout_lib.data.sft import load_examples

__all__ = [
    "DataError",
    "generate_reasoning_gym_prompts",
    "load_env_prompts",
    "load_examples",
    "load_jsonl_prompts",
    "load_pairs",
    "load_responses",
]
