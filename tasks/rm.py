"""Prefect tasks of the train-rm flow: thin wrappers that read ids from the store, call rollout_lib, return ids.

Task results are small JSON (ids and numbers) so they persist and come back `Cached` on a rerun.
"""

from __future__ import annotations

from prefect import task

from rollout_lib import wire
from rollout_lib.config import RmConfig
from rollout_lib.config.loading import training_hash
from rollout_lib.data import load_pairs
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.rm import RewardModelTrainer, RmRun, evaluate_pairs, plan_batches, tokenize_pairs
from rollout_lib.trainer import live
from tasks.common import TASK_OPTIONS, content_key, file_digest, open_store


def _dataset_path(config: RmConfig, split: str) -> str:
    dataset = config.settings.dataset if split == "train" else config.settings.eval_dataset
    return dataset.path


def _run(config: RmConfig, tokenized_id: str, plan_id: str) -> RmRun:
    return RmRun(open_store(config), config, training_hash(config), tokenized_id, plan_id)


@task(name="load-pairs", task_run_name="load-pairs-{split}", **TASK_OPTIONS,
      cache_key_fn=content_key(extra=lambda p: {"file": file_digest(_dataset_path(p["config"], p["split"]))}))
def load_pairs_task(config: RmConfig, split: str) -> dict:
    table = load_pairs(_dataset_path(config, split))
    return {"pairs": open_store(config).put_table(table), "rows": table.num_rows}


@task(name="tokenize-pairs", task_run_name="tokenize-pairs-{split}", **TASK_OPTIONS, cache_key_fn=content_key())
def tokenize_pairs_task(config: RmConfig, pairs_id: str, split: str) -> dict:
    store = open_store(config)
    tokenizer = load_tokenizer(resolve_model(config.settings.base_model))
    table = tokenize_pairs(store.get_table(pairs_id, wire.PAIRS), tokenizer, config.settings.max_seq_len)
    return {"tokenized": store.put_table(table)}


@task(name="plan-batches", task_run_name="plan-batches", **TASK_OPTIONS, cache_key_fn=content_key())
def plan_batches_task(config: RmConfig, tokenized_id: str, rows: int) -> dict:
    settings = config.settings
    plan = plan_batches(rows, settings.minibatch_size, settings.budget.max_steps, config.run.seed)
    return {"plan": open_store(config).put_table(plan), "steps": plan.num_rows}


@task(name="init-model", task_run_name="init-model", **TASK_OPTIONS, cache_key_fn=content_key())
def init_model_task(config: RmConfig, tokenized_id: str, plan_id: str) -> dict:
    trainer = RewardModelTrainer.initial(_run(config, tokenized_id, plan_id))
    live.adopt(trainer.checkpoint_id, trainer)  # step 1 (and the step-0 evaluation) reuse it in this process
    return {"checkpoint": trainer.checkpoint_id}


@task(name="train-step", task_run_name="train-step-{step}", **TASK_OPTIONS, cache_key_fn=content_key())
def train_step_task(config: RmConfig, tokenized_id: str, plan_id: str, state_id: str, step: int) -> dict:
    run = _run(config, tokenized_id, plan_id)
    state, metrics = live.advance(
        run.store, state_id, step,
        open_checkpoint=lambda checkpoint_id: RewardModelTrainer.from_checkpoint(run, checkpoint_id),
        identity={"settings_hash": run.settings_hash, "tokenized": tokenized_id, "plan": plan_id},
    )
    return {"state": state, "metrics": metrics}


@task(name="snapshot", task_run_name="snapshot-step-{step}", **TASK_OPTIONS,
      cache_key_fn=content_key(ignore=("metrics",)))
def snapshot_task(config: RmConfig, tokenized_id: str, plan_id: str, state_id: str, step: int,
                  metrics: dict) -> dict:
    run = _run(config, tokenized_id, plan_id)
    checkpoint = live.snapshot(
        run.store, state_id, metrics,
        open_checkpoint=lambda checkpoint_id: RewardModelTrainer.from_checkpoint(run, checkpoint_id),
    )
    return {"checkpoint": checkpoint}


@task(name="evaluate", task_run_name="evaluate-{label}", **TASK_OPTIONS, cache_key_fn=content_key())
def evaluate_task(config: RmConfig, checkpoint_id: str, tokenized_id: str, label: str) -> dict:
    run = _run(config, tokenized_id, plan_id="")
    store = run.store
    trainer = live.live_trainer(checkpoint_id) or RewardModelTrainer.from_checkpoint(run, checkpoint_id)
    table = store.get_table(tokenized_id, wire.TOKENIZED_PAIRS)
    return evaluate_pairs(trainer.model, table, trainer.tokenizer.pad_token_id, config.settings.eval_batch_size)
