"""The trainer's per-token logprobs of a stored RL step's samples, computed on demand (`rollout runs samples
--trainer-logprobs`): where the sampler's numbers and the trainer's disagree, sample by sample.

A step stores what the sampler reported (`sampling_logprobs`) and the behaviour logprobs the ratio divided by, but
not the training forward's (`behaviour_logprobs = "training_forward"`, the default on an engine at k = 0, stores
NaN there). So they are computed here, after the fact, the way the run's own recompute does (rl/behaviour.py: the
same chunks, the same forward, at the temperature each token was sampled at): the policy is rebuilt at the state
that sampled the step (`sampled_from`) from the store alone (rl/policy_state.py `rebuild_policy`: its checkpoint,
or the last snapshot before it with the recorded steps after it replayed), with the settings the run recorded as
it started (runlog/run_settings.py). A state trained data-parallel is replayed in this one process, so its
weights, and these logprobs, agree with the run's within float rounding, not bit for bit.

Rows sampled by a frozen or served model (`frozen:...`, `served:...`) have no trainer state: None there, as on
tokens the policy did not sample (an episode's environment replies) and past the sample's `max_seq_len`.
"""

from __future__ import annotations

import math

from rollout_lib import wire
from rollout_lib.config.rl import RlConfig
from rollout_lib.rl.behaviour import CHUNK_ROWS, ForwardInputs, chunk_logprobs
from rollout_lib.rl.policy_state import policy_inputs, rebuild_policy
from rollout_lib.runlog.run_settings import read_run_settings
from rollout_lib.runlog.step_tables import read_step_tables
from rollout_lib.store import ObjectStore, StoreError

FROZEN_PREFIXES = ("frozen:", "served:")  # rollouts sampled by a model the run does not train


def trainer_logprobs(store: ObjectStore, run_name: str, step: int) -> dict[str, list[float | None]]:
    """sample_id -> one value per completion token: the trainer's logprob of it at the state that sampled it, or
    None (see above). A StoreError naming the run and what to do when it cannot be computed."""
    record = read_step_tables(store, run_name, step)
    if record is None or not record.get("samples"):
        raise StoreError(f"run {run_name!r} in {store.root} has no training samples of step {step}")
    config = recorded_config(store, run_name)
    rollouts = store.get_table(record["scored"], wire.ROLLOUTS)
    samples = store.get_table(record["samples"], wire.TRAINING_SAMPLES)
    inputs = policy_inputs(store, config, record["prompts"])
    streams = samples.select(["sample_id", "input_ids", "loss_mask", "temperatures"]).to_pylist()
    by_sample = {row["sample_id"]: row for row in streams}

    values: dict[str, list[float | None]] = {}
    table = rollouts.to_pylist()
    for state_id in dict.fromkeys(rollout["sampled_from"] for rollout in table):  # each sampling state once
        rows = [rollout for rollout in table if rollout["sampled_from"] == state_id]
        values.update({rollout["sample_id"]: [None] * len(rollout["completion_ids"]) for rollout in rows})
        if state_id is None or state_id.startswith(FROZEN_PREFIXES):
            continue
        _check_identity(store, run_name, step, state_id, inputs.identity)
        trainer = rebuild_policy(inputs, state_id)
        model = trainer.model.eval()
        pad = trainer.tokenizer.pad_token_id or 0
        trained = [(rollout, by_sample[rollout["sample_id"]]) for rollout in rows
                   if rollout["sample_id"] in by_sample]
        for start in range(0, len(trained), CHUNK_ROWS):
            chunk = trained[start:start + CHUNK_ROWS]
            forwards = chunk_logprobs(model, [ForwardInputs.of(sample["input_ids"], sample["loss_mask"],
                                                               sample["temperatures"]) for _, sample in chunk], pad)
            for (rollout, sample), per_token in zip(chunk, forwards):
                values[rollout["sample_id"]] = _completion_values(rollout, sample, per_token)
    return values


def recorded_config(store: ObjectStore, run_name: str) -> RlConfig:
    """The RL settings the run recorded as it started, reading from `store`; a StoreError naming what to do."""
    recorded = read_run_settings(store, run_name)
    if recorded is None:
        raise StoreError(f"run {run_name!r} in {store.root} has no recorded settings (it ran before rollout kept "
                         "them): rerun its command, whose finished steps come back from cache, to record them")
    if recorded["settings"].get("algorithm", {}).get("kind") != "rl":
        raise StoreError(f"run {run_name!r} in {store.root} is not an RL run: only train-rl's steps have samples")
    settings = dict(recorded["settings"])
    settings["run"] = {**settings["run"], "store": store.root}  # read where the samples are, not where it ran
    return RlConfig.model_validate(settings)


def _check_identity(store: ObjectStore, run_name: str, step: int, state_id: str, identity: str) -> None:
    """The recorded settings must be the ones that trained the state (a run name holds one training, but a
    record written by another version of rollout could hash them otherwise): replaying with others would compute
    another policy's logprobs."""
    trained_by = store.get_json(state_id).get("training_identity")
    if trained_by is not None and trained_by != identity:
        raise StoreError(f"run {run_name!r} in {store.root}: step {step} was sampled from state {state_id}, trained "
                         f"as {trained_by[:12]}, but the run's recorded settings hash to {identity[:12]}: rerun the "
                         "run's command with this rollout to record settings that rebuild it")


def _completion_values(rollout: dict, sample: dict, per_token: list[float]) -> list[float | None]:
    """The completion tokens' values out of the sample's streams (prompt first): the forward's value where the
    sample's loss mask read the token, else None."""
    length = len(rollout["completion_ids"])
    offset = len(rollout["prompt_ids"])
    out: list[float | None] = []
    for position in range(offset, offset + length):
        read = position < len(sample["loss_mask"]) and sample["loss_mask"][position]
        value = float(per_token[position]) if read else None
        out.append(None if value is None or math.isnan(value) else value)
    return out
