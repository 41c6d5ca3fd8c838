"""JSONL loaders into Arrow tables; malformed rows are errors `path:lineno: reason`."""

from rollout_lib.data.jsonl import DataError
from rollout_lib.data.pairs import load_pairs, load_responses

__all__ = ["DataError", "load_pairs", "load_responses"]
