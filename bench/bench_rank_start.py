"""One data-parallel group's start (issue 39): sft-tiny, `--nproc 2`, its ranks forked from the launcher
(trainer/torchrun.py) against fresh interpreters (ROLLOUT_RANK_START=fresh), alternating.

For each start: the wall seconds from the group's start to every rank connected (`ready`), then to the end of a
one-step segment (`+step`: the ranks build the trainer, importing what they import lazily), and the CPU-seconds of
torchrun and its ranks over the whole life of the group (they are reaped before the group's `close` returns).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_rank_start.py [REPEATS]
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time

from rollout_lib.config import SftConfig
from rollout_lib.data import load_examples
from rollout_lib.determinism import plan_batches
from rollout_lib.identity.training import training_identity
from rollout_lib.model.loading import resolve_model
from rollout_lib.plan_checks import load_config
from rollout_lib.sft.batches import plan_micro_batches
from rollout_lib.sft.tokenize import sft_tokenizer, tokenize_examples
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, PlannedBatches
from rollout_lib.trainer.segment_group import SegmentGroup
from rollout_lib.trainer.torchrun import RANK_START_ENV


def inputs(store_path: str):
    config = load_config(SftConfig, "configs/sft-tiny.toml", {
        "run.store": store_path, "algorithm.sft.minibatch_size": 2, "algorithm.sft.budget.max_steps": 1,
        "algorithm.sft.hardware.nproc": 2})
    store, settings = ObjectStore(store_path), config.settings
    tokenized = tokenize_examples(load_examples(settings.dataset.path),
                                  sft_tokenizer(resolve_model(settings.base_model)), loss_on=settings.loss_on.kind,
                                  max_seq_len=settings.packing.max_seq_len, source=settings.dataset.path)
    plan = plan_batches(tokenized.samples.num_rows, settings.minibatch_size, 1, config.run.seed)
    micro_batches, plan = plan_micro_batches(tokenized.samples, plan, settings)
    training = TrainingInputs(store, config, training_identity(config), {"samples": store.put_table(tokenized.samples)})
    return training, PlannedBatches(store, store.put_table(micro_batches), store.put_table(plan))


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_start(training, batches, start: str) -> tuple[float, float, float, str]:
    os.environ[RANK_START_ENV] = start
    checkpoint = CausalLmTrainer.initial(training, batches=batches).checkpoint_id
    group = SegmentGroup(CausalLmTrainer, training, {"batches": batches})
    cpu, began = children_cpu(), time.monotonic()
    group.ranks._start("start", "rerun")
    ready = time.monotonic() - began
    ended, _ = group.train(checkpoint, 1, 1)
    step = time.monotonic() - began
    group.close()
    return ready, step, children_cpu() - cpu, ended


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as store:
        training, batches = inputs(store)
        ends = set()
        for _ in range(repeats):
            for start in ("fork", "fresh"):
                ready, step, cpu, ended = one_start(training, batches, start)
                ends.add(ended)
                load = os.getloadavg()[0]
                print(f"{start:5s}  ready {ready:5.2f} s  +step {step:5.2f} s  CPU {cpu:5.2f} s  (load {load:.1f})",
                      flush=True)
        print("every start ended on the same checkpoint:", len(ends) == 1, sorted(ends))


if __name__ == "__main__":
    main()
