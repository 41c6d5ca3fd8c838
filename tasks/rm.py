"""Prefect tasks of the train-rm flow: thin wrappers that read ids from the store, call rollout_lib, return ids.

Task results are small JSON (ids and numbers) so they persist and come back `Cached` on a rerun. Each key holds the
settings its task reads (tasks.common.content_key): the training tasks the chain's identity, the data tasks only
their own settings.
"""

from __future__ import annotations

from prefect import task

from rollout_lib import wire
from rollout_lib.config import RmConfig
from rollout_lib.config.common import dataset_locator, dataset_setting
from rollout_lib.data import read_pairs
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.rm.evaluate import evaluate_pairs_with_rows
from rollout_lib.rm.pairs import tokenize_pairs
from rollout_lib.rm.trainer import RewardModelTrainer
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.segment_group import data_parallel_segment
from rollout_lib.identity.data_keys import rm_tokenizer_reads
from rollout_lib.identity.training import training_identity
from rollout_lib.trainer.resident import ResidentTrainer
from rollout_lib.trainer.segment import Segment, run_segment
from tasks.common import TASK_OPTIONS, content_key, dataset_load_key, open_store


def _inputs(config: RmConfig, tokenized_id: str) -> TrainingInputs:
    return TrainingInputs(open_store(config), config, training_identity(config), {"tokenized": tokenized_id})


@task(name="load-pairs", task_run_name="load-pairs-{split}", **TASK_OPTIONS, cache_key_fn=dataset_load_key)
def load_pairs_task(config: RmConfig, split: str) -> dict:
    table = read_pairs(dataset_setting(config, split), dataset_locator(config, split))
    return {"pairs": open_store(config).put_table(table), "rows": table.num_rows}


@task(name="tokenize-pairs", task_run_name="tokenize-pairs-{split}", **TASK_OPTIONS,
      cache_key_fn=content_key(reads=rm_tokenizer_reads, ignore=("split",)))
def tokenize_pairs_task(config: RmConfig, pairs_id: str, split: str) -> dict:
    store = open_store(config)
    tokenizer = load_tokenizer(resolve_model(config.settings.base_model))
    table = tokenize_pairs(store.get_table(pairs_id, wire.PAIRS), tokenizer, config.settings.max_seq_len,
                           config.settings.head)
    return {"tokenized": store.put_table(table)}


@task(name="init-model", task_run_name="init-model", **TASK_OPTIONS, cache_key_fn=content_key())
def init_model_task(config: RmConfig, tokenized_id: str, resident: ResidentTrainer) -> dict:
    trainer = RewardModelTrainer.initial(_inputs(config, tokenized_id))
    resident.put(trainer.checkpoint_id, trainer)  # the first segment (and the step-0 evaluation) reuse it
    return {"checkpoint": trainer.checkpoint_id}


@task(name="train-steps", task_run_name="train-steps-{first}-{last}", **TASK_OPTIONS,
      cache_key_fn=content_key(ignore=("checkpoint_id",)))
def train_segment_task(config: RmConfig, tokenized_id: str, checkpoint_id: str, first: int, last: int,
                       resident: ResidentTrainer) -> dict:
    """Steps first..last from `checkpoint_id`, then a snapshot: {"checkpoint", "metrics": one dict per step}.
    Keyed by the chain and the steps, not by the start checkpoint's id: the same training, whatever the snapshots
    before it were."""
    inputs = _inputs(config, tokenized_id)
    checkpoint, metrics, trainer = run_segment(
        inputs.store, inputs.identity, inputs.data_ids, Segment(first, last),
        open_trainer=lambda: resident.pop(checkpoint_id) or RewardModelTrainer.from_checkpoint(inputs, checkpoint_id),
        train_elsewhere=data_parallel_segment(RewardModelTrainer, inputs, checkpoint_id, resident))
    if trainer is not None:
        resident.put(checkpoint, trainer)
    return {"checkpoint": checkpoint, "metrics": metrics}


@task(name="evaluate", task_run_name="evaluate-{label}", **TASK_OPTIONS,
      cache_key_fn=content_key(reads=lambda config: config.settings.eval_batch_size, ignore=("label",)))
def evaluate_task(config: RmConfig, checkpoint_id: str, tokenized_id: str, label: str,
                  resident: ResidentTrainer) -> dict:
    """Held-out accuracy, mean margin and loss of the checkpoint, and the id of its per-pair rows."""
    # Without a resident trainer at the checkpoint, one is rebuilt only to run its model (no data ids needed).
    trainer = resident.get(checkpoint_id) or RewardModelTrainer.from_checkpoint(_inputs(config, ""), checkpoint_id)
    store = open_store(config)
    metrics, rows = evaluate_pairs_with_rows(trainer.model, store.get_table(tokenized_id, wire.TOKENIZED_PAIRS),
                                             trainer.tokenizer.pad_token_id, config.settings.eval_batch_size,
                                             config.settings.head)
    return {**metrics, "rows": store.put_table(rows)}  # rows: each pair's scores (wire.RM_EVAL_ROWS)
