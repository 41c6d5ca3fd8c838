"""train-rm: Bradley-Terry reward-model training, as the procedure you would write by hand.

load pairs -> tokenize -> init model -> [train steps a..b, snapshot] per segment -> evaluate (metrics, and each
held-out pair's scores recorded for `rollout runs samples --eval`)

A segment runs from one snapshot to the next (`checkpoint_interval` steps) as one task: plain torch inside,
one orchestration round trip per segment.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flows.common import (
    flow_run_name,
    recorded_run,
    start_run,
    train_in_segments,
)
from rollout_lib.config import RmConfig
from rollout_lib.runlog.step_log import segment_means
from rollout_lib.trainer.resident import ResidentTrainer
from tasks.rm import (
    evaluate_task,
    init_model_task,
    load_pairs_task,
    tokenize_pairs_task,
    train_segment_task,
)

# Metrics shown per step in the UI table (and their column order).
METRIC_COLUMNS = ("step", "loss", "accuracy", "mean_margin", "lr", "grad_norm", "pairs_per_s")


@flow(name="train-rm", flow_run_name=flow_run_name, log_prints=True)
def train_rm(config: str = "configs/rm-default.toml", overrides: list[str] | dict[str, Any] | None = None,
             max_steps: int | None = None) -> dict:
    """Train a reward model. `overrides`: ["key.path=value", ...] or {"key.path": value}; `max_steps` is a
    shortcut for algorithm.rm.budget.max_steps."""
    logger = get_run_logger()
    run = start_run("train-rm", RmConfig, config, overrides, max_steps, "algorithm.rm.budget.max_steps")
    cfg, settings, run_task = run.cfg, run.cfg.settings, run.tasks
    with ResidentTrainer() as resident, recorded_run(cfg, settings.budget.max_steps) as recorder:
        train = run_task(load_pairs_task)(cfg, "train")
        tokenized = run_task(tokenize_pairs_task)(cfg, train["pairs"], "train")["tokenized"]
        held_out = eval_pairs = None
        if settings.eval_dataset is not None:
            eval_pairs = run_task(load_pairs_task)(cfg, "eval")["pairs"]
            held_out = run_task(tokenize_pairs_task)(cfg, eval_pairs, "eval")["tokenized"]

        initial = run_task(init_model_task)(cfg, tokenized, resident)["checkpoint"]

        def report(segment, checkpoint, metrics):
            means = segment_means(metrics, ("loss", "accuracy"))
            logger.info("steps %d-%d: mean loss %.4f, mean accuracy %.3f -> checkpoint %s", segment.first,
                        segment.last, means["loss"], means["accuracy"], checkpoint[:12])

        checkpoint, history, before, after, train_seconds = train_in_segments(
            run, evaluate_task, train_segment_task, (tokenized,), initial, resident=resident, recorder=recorder,
            held_out=None if held_out is None else (held_out, eval_pairs), on_segment=report,
            describe=lambda metrics: f"accuracy {metrics['accuracy']:.3f} over {metrics['pairs']} pairs")
    return run.finish(checkpoint, history, METRIC_COLUMNS, _summary(cfg, checkpoint, before, after), {
        "eval_before": before, "eval_after": after, "last_metrics": history[-1], "train_seconds": train_seconds})


def _summary(cfg: RmConfig, checkpoint: str, before: dict | None, after: dict | None) -> str:
    lines = [
        f"# train-rm `{cfg.run.name}`",
        "",
        f"- final checkpoint: `{checkpoint}`",
        f"- store: `{cfg.run.store}`",
        f"- base model: `{cfg.settings.base_model.uri}`, steps: {cfg.settings.budget.max_steps}",
    ]
    if before and after:
        lines += [
            "",
            "| held-out | accuracy | mean margin | loss |",
            "|---|---|---|---|",
            f"| before | {before['accuracy']:.3f} | {before['mean_margin']:.3f} | {before['loss']:.4f} |",
            f"| after | {after['accuracy']:.3f} | {after['mean_margin']:.3f} | {after['loss']:.4f} |",
        ]
    return "\n".join(lines)
