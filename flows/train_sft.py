"""train-sft: supervised fine-tuning, as the procedure you would write by hand.

load examples -> tokenize (chat template, loss masks) -> plan batches -> pack micro-batches -> init model
-> [train steps a..b, snapshot] per segment -> evaluate (metrics, and each held-out example's loss recorded for
`rollout runs samples --eval`)

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
from rollout_lib.config import SftConfig
from rollout_lib.runlog.step_log import segment_means
from rollout_lib.trainer.resident import ResidentTrainer
from tasks.sft import (
    evaluate_task,
    init_model_task,
    load_examples_task,
    pack_micro_batches_task,
    plan_batches_task,
    tokenize_examples_task,
    train_segment_task,
)

# Metrics shown per step in the UI table (and their column order).
METRIC_COLUMNS = ("step", "loss", "tokens/ce", "lr", "grad_norm", "micro_batches", "nonpad_fraction", "tokens_per_s")


@flow(name="train-sft", flow_run_name=flow_run_name, log_prints=True)
def train_sft(config: str = "configs/sft-tiny.toml", overrides: list[str] | dict[str, Any] | None = None,
              max_steps: int | None = None) -> dict:
    """Fine-tune a causal LM on conversations. `overrides`: ["key.path=value", ...] or {"key.path": value};
    `max_steps` is a shortcut for algorithm.sft.budget.max_steps."""
    logger = get_run_logger()
    run = start_run("train-sft", SftConfig, config, overrides, max_steps, "algorithm.sft.budget.max_steps")
    cfg, settings, run_task = run.cfg, run.cfg.settings, run.tasks
    with ResidentTrainer() as resident, recorded_run(cfg, settings.budget.max_steps) as recorder:
        train = run_task(load_examples_task)(cfg, "train")
        tokenized = run_task(tokenize_examples_task)(cfg, train["examples"], "train")
        _report_tokenized(logger, cfg, tokenized, "train")
        plan = run_task(plan_batches_task)(cfg, tokenized["samples"], tokenized["kept"])["plan"]
        packed = run_task(pack_micro_batches_task)(cfg, tokenized["samples"], plan)
        stats = packed["stats"]
        logger.info("%d micro-batches over %d steps (packing %s): %d tokens, %.1f%% of processed positions real",
                    stats["micro_batches"], settings.budget.max_steps, settings.packing.kind, stats["tokens"],
                    100 * stats["nonpad_fraction"])
        held_out = eval_examples = None
        if settings.eval_dataset is not None:
            eval_examples = run_task(load_examples_task)(cfg, "eval")["examples"]
            eval_tokenized = run_task(tokenize_examples_task)(cfg, eval_examples, "eval")
            _report_tokenized(logger, cfg, eval_tokenized, "eval")
            held_out = eval_tokenized["samples"]

        data = (tokenized["samples"], packed["micro_batches"], packed["plan"])
        initial = run_task(init_model_task)(cfg, *data, resident)["checkpoint"]

        def report(segment, checkpoint, metrics):
            logger.info("steps %d-%d: mean loss %.4f over %d tokens -> checkpoint %s", segment.first, segment.last,
                        segment_means(metrics, ("loss",))["loss"], sum(m["tokens/ce"] for m in metrics),
                        checkpoint[:12])

        checkpoint, history, before, after, train_seconds = train_in_segments(
            run, evaluate_task, train_segment_task, data, initial, resident=resident, recorder=recorder,
            held_out=None if held_out is None else (held_out, eval_examples), on_segment=report,
            describe=lambda metrics: f"loss {metrics['loss']:.4f} over {metrics['tokens']} tokens")
    return run.finish(checkpoint, history, METRIC_COLUMNS, _summary(cfg, checkpoint, tokenized, packed, before, after),
                      {"eval_before": before, "eval_after": after, "last_metrics": history[-1],
                       "data": {"tokenized": tokenized, "packed": packed}, "train_seconds": train_seconds})


def _report_tokenized(logger, cfg: SftConfig, tokenized: dict, split: str) -> None:
    empty = tokenized["empty_mask_lines"]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (", ..." if len(empty) > 10 else "")
        logger.warning("%s: %d of %d rows have nothing to train on (loss_on=%s, max_seq_len=%d) and are left out: "
                       "lines %s", split, len(empty), tokenized["rows"], cfg.settings.loss_on.kind,
                       cfg.settings.packing.max_seq_len, shown)
    if tokenized["truncated"]:
        logger.info("%s: %d rows truncated to %d tokens", split, tokenized["truncated"],
                    cfg.settings.packing.max_seq_len)


def _summary(cfg: SftConfig, checkpoint: str, tokenized: dict, packed: dict, before: dict | None,
             after: dict | None) -> str:
    settings = cfg.settings
    lines = [
        f"# train-sft `{cfg.run.name}`",
        "",
        f"- final checkpoint: `{checkpoint}`",
        f"- store: `{cfg.run.store}`",
        f"- base model: `{settings.base_model.uri}`, steps: {settings.budget.max_steps}, "
        f"loss on: {settings.loss_on.kind}",
        f"- data: {tokenized['kept']} of {tokenized['rows']} rows trained ({len(tokenized['empty_mask_lines'])} "
        f"with an empty mask), {tokenized['truncated']} truncated",
        f"- packing {settings.packing.kind}: {packed['stats']['micro_batches']} micro-batches, "
        f"{100 * packed['stats']['nonpad_fraction']:.1f}% of processed positions real",
    ]
    if before and after:
        lines += [
            "",
            "| held-out | loss per token | perplexity | tokens |",
            "|---|---|---|---|",
            f"| before | {before['loss']:.4f} | {before['perplexity']:.2f} | {before['tokens']} |",
            f"| after | {after['loss']:.4f} | {after['perplexity']:.2f} | {after['tokens']} |",
        ]
    return "\n".join(lines)
