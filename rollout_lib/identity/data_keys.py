"""What SFT's and RM's data tasks (load, tokenize, plan, pack) read besides the training identity: the split's data (a
JSONL file's digest, a table's content identity) and the settings each task applies. Apart from identity/sources.py
(RL's user code and prompts) so that an SFT or RM task's code version, its static import closure
(identity/code.py), holds no RL module: editing RL code never invalidates their cached results."""

from __future__ import annotations

from rollout_lib.config.common import dataset_locator, dataset_setting
from rollout_lib.data.sources import is_table_source
from rollout_lib.identity.digests import file_digest, source_identity
from rollout_lib.model.loading import model_content_digest
from rollout_lib.rm.heads import DEFAULT_HEAD


def dataset_identity(config, split: str) -> dict:
    """What a load task reads of its split's data: a JSONL file's path and digest (as it always has), a table's
    content digest, split and column mapping, never its path."""
    dataset = dataset_setting(config, split)
    if is_table_source(dataset):
        return {"source": source_identity(dataset, dataset_locator(config, split))}
    return {"path": dataset.path, "file": file_digest(dataset.path)}


def sft_tokenizer_reads(config) -> dict:
    settings = config.settings
    reads = {"tokenizer": model_content_digest(settings.base_model), "loss_on": settings.loss_on.kind,
             "max_seq_len": settings.packing.max_seq_len}
    if settings.chat_template is not None:  # the template's content; absent without one, as keys were
        reads["chat_template"] = file_digest(settings.chat_template)
    return reads


def sft_plan_reads(config) -> dict:
    settings = config.settings
    return {"minibatch_size": settings.minibatch_size, "max_steps": settings.budget.max_steps, "seed": config.run.seed}


def sft_packing_reads(config) -> dict:
    settings = config.settings
    return {"packing": settings.packing.model_dump(), "gradient_accumulation": settings.gradient_accumulation,
            "minibatch_size": settings.minibatch_size}


def rm_tokenizer_reads(config) -> dict:
    reads = {"tokenizer": model_content_digest(config.settings.base_model), "max_seq_len": config.settings.max_seq_len}
    if config.settings.head != DEFAULT_HEAD:  # the head decides the inputs; absent at the default, as keys were
        reads["head"] = config.settings.head
    return reads
