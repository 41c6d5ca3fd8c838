"""Prefect tasks of the train-sft flow: thin wrappers that read ids from the store, call rollout_lib, return ids.

Each key holds the settings its task reads (tasks.common.content_key): the training tasks the chain's identity
and the samples they train on; the data tasks only their own settings. Every step's micro-batches are a function
of the samples and the seed, not of the run's length, so the packed table's id (which grows with max_steps) never
enters a training key.
"""

from __future__ import annotations

from prefect import task

from rollout_lib import wire
from rollout_lib.config import SftConfig
from rollout_lib.config.common import dataset_locator, dataset_setting
from rollout_lib.identity.data_keys import sft_packing_reads, sft_plan_reads, sft_tokenizer_reads
from rollout_lib.identity.training import training_identity
from rollout_lib.data import read_examples
from rollout_lib.model.loading import resolve_model
from rollout_lib.sft.batches import micro_batches_of, padding_stats, plan_micro_batches
from rollout_lib.sft.evaluate import evaluate_nll_with_rows
from rollout_lib.sft.tokenize import sft_tokenizer, tokenize_examples
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, PlannedBatches
from rollout_lib.trainer.segment_group import data_parallel_segment
from rollout_lib.determinism import plan_batches
from rollout_lib.trainer.resident import ResidentTrainer
from rollout_lib.trainer.segment import Segment, run_segment
from tasks.common import TASK_OPTIONS, content_key, dataset_load_key, open_store


def _inputs(config: SftConfig, samples_id: str) -> TrainingInputs:
    return TrainingInputs(open_store(config), config, training_identity(config), {"samples": samples_id})


@task(name="load-examples", task_run_name="load-examples-{split}", **TASK_OPTIONS, cache_key_fn=dataset_load_key)
def load_examples_task(config: SftConfig, split: str) -> dict:
    table = read_examples(dataset_setting(config, split), dataset_locator(config, split))
    return {"examples": open_store(config).put_table(table), "rows": table.num_rows}


@task(name="tokenize-examples", task_run_name="tokenize-examples-{split}", **TASK_OPTIONS,
      cache_key_fn=content_key(reads=sft_tokenizer_reads,
                               extra=lambda p: {"source": dataset_setting(p["config"], p["split"]).path}))
def tokenize_examples_task(config: SftConfig, examples_id: str, split: str) -> dict:
    """Returns the samples id and a report: rows kept, rows truncated, lines left out with an empty mask."""
    store = open_store(config)
    settings = config.settings
    tokenized = tokenize_examples(
        store.get_table(examples_id, wire.EXAMPLES),
        sft_tokenizer(resolve_model(settings.base_model), settings.chat_template),
        loss_on=settings.loss_on.kind, max_seq_len=settings.packing.max_seq_len,
        source=dataset_setting(config, split).path)
    return {"samples": store.put_table(tokenized.samples), **tokenized.report()}


@task(name="plan-batches", task_run_name="plan-batches", **TASK_OPTIONS, cache_key_fn=content_key(reads=sft_plan_reads))
def plan_batches_task(config: SftConfig, samples_id: str, rows: int) -> dict:
    settings = config.settings
    plan = plan_batches(rows, settings.minibatch_size, settings.budget.max_steps, config.run.seed)
    return {"plan": open_store(config).put_table(plan), "steps": plan.num_rows}


@task(name="pack-micro-batches", task_run_name="pack-micro-batches", **TASK_OPTIONS,
      cache_key_fn=content_key(reads=sft_packing_reads))
def pack_micro_batches_task(config: SftConfig, samples_id: str, plan_id: str) -> dict:
    """Every step's micro-batches (packed or padded), checked for alignment; returns ids and padding stats."""
    store = open_store(config)
    micro_batches, plan = plan_micro_batches(store.get_table(samples_id, wire.TRAINING_SAMPLES),
                                             store.get_table(plan_id, wire.BATCH_PLAN), config.settings)
    return {"micro_batches": store.put_table(micro_batches), "plan": store.put_table(plan),
            "stats": padding_stats(micro_batches, packed=config.settings.packed)}


@task(name="init-model", task_run_name="init-model", **TASK_OPTIONS,
      cache_key_fn=content_key(ignore=("micro_batches_id", "plan_id")))
def init_model_task(config: SftConfig, samples_id: str, micro_batches_id: str, plan_id: str,
                    resident: ResidentTrainer) -> dict:
    inputs = _inputs(config, samples_id)
    trainer = CausalLmTrainer.initial(inputs, batches=PlannedBatches(inputs.store, micro_batches_id, plan_id))
    resident.put(trainer.checkpoint_id, trainer)  # the first segment (and the step-0 evaluation) reuse it
    return {"checkpoint": trainer.checkpoint_id}


@task(name="train-steps", task_run_name="train-steps-{first}-{last}", **TASK_OPTIONS,
      cache_key_fn=content_key(ignore=("micro_batches_id", "plan_id", "checkpoint_id")))
def train_segment_task(config: SftConfig, samples_id: str, micro_batches_id: str, plan_id: str, checkpoint_id: str,
                       first: int, last: int, resident: ResidentTrainer) -> dict:
    """Steps first..last from `checkpoint_id`, then a snapshot: {"checkpoint", "metrics": one dict per step}.
    Keyed by the chain, its samples and the steps (see the module docstring)."""
    inputs = _inputs(config, samples_id)

    def open_trainer():
        return resident.pop(checkpoint_id) or CausalLmTrainer.from_checkpoint(
            inputs, checkpoint_id, batches=PlannedBatches(inputs.store, micro_batches_id, plan_id))

    checkpoint, metrics, trainer = run_segment(
        inputs.store, inputs.identity, inputs.data_ids, Segment(first, last), open_trainer,
        train_elsewhere=data_parallel_segment(CausalLmTrainer, inputs, checkpoint_id, resident,
                                              batches=PlannedBatches(inputs.store, micro_batches_id, plan_id)))
    if trainer is not None:
        resident.put(checkpoint, trainer)
    return {"checkpoint": checkpoint, "metrics": metrics}


@task(name="evaluate", task_run_name="evaluate-{label}", **TASK_OPTIONS,
      cache_key_fn=content_key(reads=sft_packing_reads, ignore=("label",)))
def evaluate_task(config: SftConfig, checkpoint_id: str, samples_id: str, label: str,
                  resident: ResidentTrainer) -> dict:
    """Held-out loss per trained token of the checkpoint, over the eval samples micro-batched as in training, and
    the id of its per-example rows."""
    # Without a resident trainer at the checkpoint, one is rebuilt only to run its model (no data ids needed).
    trainer = resident.get(checkpoint_id) or CausalLmTrainer.from_checkpoint(_inputs(config, ""), checkpoint_id)
    settings = config.settings
    store = trainer.inputs.store
    micro_batches = micro_batches_of(store.get_table(samples_id, wire.TRAINING_SAMPLES), settings)
    metrics, rows = evaluate_nll_with_rows(trainer.model, micro_batches, packed=settings.packed,
                                           pad_token_id=trainer.tokenizer.pad_token_id)
    return {**metrics, "rows": store.put_table(rows)}  # rows: each example's loss (wire.SFT_EVAL_ROWS)
