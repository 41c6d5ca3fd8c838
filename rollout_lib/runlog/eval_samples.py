"""A run's held-out examples with the model's predictions, read from the rows its evaluations stored (`rollout runs
samples --eval`, docs/runs.md; runlog/eval_tables.py says where they are). One row per held-out example:

    reward model (train-rm)   pair_index, source_line, prompt, chosen, rejected, r_chosen, r_rejected, margin
                              (r_chosen - r_rejected), loss (-log σ(margin)), correct (margin > 0)
    SFT (train-sft)           sample_id, source_line, messages (the conversation), prompt (its messages before the
                              last assistant one), completion (that one's text), nll_sum, tokens, loss (per token)

Worst first: a reward model's lowest margin, an SFT model's highest loss per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_lib import wire
from rollout_lib.data.tool_messages import template_messages
from rollout_lib.runlog.eval_tables import read_eval_tables, recorded_evals
from rollout_lib.runlog.metrics_file import read_metrics
from rollout_lib.runlog.runs import check_run
from rollout_lib.runlog.samples import read_eval_samples
from rollout_lib.store import ObjectNotFoundError, ObjectStore, StoreError


@dataclass(frozen=True)
class EvalSamples:
    run: str
    step: int
    steps: list[int]  # every step of the run with a recorded evaluation
    algorithm: str  # "rm" or "sft"
    rows: list[dict]  # in the eval data's order


def read_eval_rows(store: ObjectStore, run_name: str, step: int | None = None) -> EvalSamples:
    """The evaluation at ``step``'s rows (default: the latest, after training). A StoreError naming the run and
    what to do otherwise; an RL run's is `samples.read_eval_samples`'s (its evaluations keep only metrics)."""
    check_run(store, run_name)
    steps = recorded_evals(store, run_name)
    if not steps:
        if any("reward_mean" in record for record in read_metrics(store, run_name)):
            read_eval_samples(store, run_name, step)  # raises: what RL's held-out evaluations keep
        raise StoreError(f"run {run_name!r} in {store.root} has no held-out evaluation recorded: it has no "
                         "eval_dataset, or it evaluated before rollout kept each example's result; rerun its command "
                         "(training comes back from cache) to record them")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise StoreError(f"run {run_name!r} in {store.root} has no held-out evaluation at step {step}: it evaluated "
                         f"at steps {', '.join(map(str, steps))}; pick one with --step")
    record = read_eval_tables(store, run_name, step)
    if record is None or record["rows"] is None:
        raise StoreError(f"the held-out evaluation at step {step} of run {run_name!r} came from a cache written "
                         "before rollout kept each example's result: rerun the run's command to record them")
    try:
        rows = (_rm_rows if record["algorithm"] == "rm" else _sft_rows)(store, record)
    except ObjectNotFoundError as exc:
        raise StoreError(f"the held-out rows of step {step} of run {run_name!r} are gone from {store.root} ({exc}; "
                         "`rollout gc` deletes them once the run is older than its grace period): rerun the run's "
                         "command to evaluate again") from None
    return EvalSamples(run_name, step, steps, record["algorithm"], rows)


def worst_first(found: EvalSamples, *, worst: int | None = None, best: int | None = None) -> list[dict]:
    """Every row worst first, the ``worst`` worst of them, or the ``best`` best, best first (ties: data order)."""
    if best:
        return sorted(found.rows, key=lambda row: -_badness(found.algorithm, row))[:best]
    ranked = sorted(found.rows, key=lambda row: _badness(found.algorithm, row))
    return ranked[:worst] if worst else ranked


def _badness(algorithm: str, row: dict) -> float:
    """Lower is worse: a reward model's margin, an SFT model's negated loss per token."""
    return row["margin"] if algorithm == "rm" else -row["loss"]


def _rm_rows(store: ObjectStore, record: dict) -> list[dict]:
    scored = store.get_table(record["rows"], wire.RM_EVAL_ROWS).to_pylist()
    pairs = store.get_table(record["data"], wire.PAIRS).select(["prompt", "chosen", "rejected"]).to_pylist()
    return [{"pair_index": row["pair_index"], "source_line": row["source_line"], **pairs[row["pair_index"]],
             **{name: row[name] for name in ("r_chosen", "r_rejected", "margin", "loss", "correct")}}
            for row in scored]


def _sft_rows(store: ObjectStore, record: dict) -> list[dict]:
    examples = store.get_table(record["data"], wire.EXAMPLES).to_pylist()
    by_sample = {wire.sft_sample_id(example["source_line"]): example for example in examples}
    rows = []
    for row in store.get_table(record["rows"], wire.SFT_EVAL_ROWS).to_pylist():
        example = by_sample.get(row["sample_id"])
        messages = template_messages(example["messages"]) if example else None
        last = _last_assistant(messages or [])
        rows.append({"sample_id": row["sample_id"], "source_line": example["source_line"] if example else None,
                     "messages": messages, "prompt": messages[:last] if last is not None else messages,
                     "completion": messages[last]["content"] if last is not None else None,
                     "nll_sum": row["nll_sum"], "tokens": row["tokens"], "loss": row["loss"]})
    return rows


def _last_assistant(messages: list[dict]) -> int | None:
    return next((index for index in range(len(messages) - 1, -1, -1) if messages[index]["role"] == "assistant"),
                None)
