"""Data-parallel training segments (trainer.data_parallel): 2 CPU processes under torchrun (gloo) train what one
process trains from the same global batch, within rounding; a rank with only empty micro-batches does not hang;
a rank SIGKILLed mid-run fails the run naming the rank and the steps, and the rerun resumes from the last snapshot.

Tolerances: gradients summed across ranks add in another order than one process accumulating them, so the numbers
agree within float32 rounding, not bit for bit (which is why nproc > 1 enters the training identity). Measured on
the tiny model (3 steps, sgd lr 0.05; docs/hardware.md): losses at most 8.7e-8 relative apart, weights at most
1.2e-7 (RM) and 7.5e-9 (SFT) absolute, while they move by ~1.5e-2; asserted: losses within 1e-5 relative,
weights within 1e-6 absolute. The SIGKILL test kills a rank through a test hook (data_parallel.KILL_RANK_ENV: the
rank SIGKILLs itself at a given step), so the kill lands at a known step on a loaded machine.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tasks.rm
import tasks.sft
from rollout_lib.identity.training import training_settings
from rollout_lib import wire
from rollout_lib.config import RmConfig, SftConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.data import load_examples, load_pairs
from rollout_lib.model.loading import load_tokenizer, resolve_model
from rollout_lib.rm.pairs import tokenize_pairs
from rollout_lib.rm.trainer import RewardModelTrainer
from rollout_lib.sft.batches import plan_micro_batches
from rollout_lib.sft.tokenize import sft_tokenizer, tokenize_examples
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.base import TrainingInputs
from rollout_lib.trainer.causal import CausalLmTrainer, PlannedBatches
from rollout_lib.checkpoint import read_manifest
from rollout_lib.trainer.data_parallel import (
    KILL_RANK_ENV,
    DataParallelRank,
    empty_micro_batch,
)
from rollout_lib.trainer.torchrun_summary import failure_message, first_failure, root_cause_rank
from rollout_lib.trainer.segment_group import run_segment_in_processes
from rollout_lib.determinism import plan_batches
from rollout_lib.identity.training import training_identity
from rollout_lib.trainer.resident import ResidentTrainer
from rollout_lib.trainer.segment import Segment, chain_ref, train_segment

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6
STEPS = 3


def sft_config(store: str, nproc: int, minibatch_size: int, gradient_accumulation: int) -> SftConfig:
    return load_config(SftConfig, "configs/sft-tiny.toml", {
        "run.store": store, "algorithm.sft.minibatch_size": minibatch_size,
        "algorithm.sft.gradient_accumulation": gradient_accumulation, "algorithm.sft.budget.max_steps": STEPS,
        "algorithm.sft.optimizer.lr": 0.05, "algorithm.sft.hardware.nproc": nproc})


def sft_inputs(config: SftConfig) -> tuple[TrainingInputs, PlannedBatches]:
    store = ObjectStore(config.run.store)
    settings = config.settings
    tokenized = tokenize_examples(load_examples(settings.dataset.path),
                                  sft_tokenizer(resolve_model(settings.base_model)), loss_on=settings.loss_on.kind,
                                  max_seq_len=settings.packing.max_seq_len, source=settings.dataset.path)
    plan = plan_batches(tokenized.samples.num_rows, settings.minibatch_size, STEPS, config.run.seed)
    micro_batches, plan = plan_micro_batches(tokenized.samples, plan, settings)
    samples_id = store.put_table(tokenized.samples)
    inputs = TrainingInputs(store, config, training_identity(config), {"samples": samples_id})
    return inputs, PlannedBatches(store, store.put_table(micro_batches), store.put_table(plan))


def rm_config(store: str, nproc: int) -> RmConfig:
    return load_config(RmConfig, "configs/rm-tiny.toml", {
        "run.store": store, "algorithm.rm.minibatch_size": 3, "algorithm.rm.budget.max_steps": STEPS,
        "algorithm.rm.optimizer.lr": 0.05, "algorithm.rm.hardware.nproc": nproc})


def rm_inputs(config: RmConfig) -> TrainingInputs:
    store = ObjectStore(config.run.store)
    settings = config.settings
    table = tokenize_pairs(load_pairs(settings.dataset.path), load_tokenizer(resolve_model(settings.base_model)),
                           settings.max_seq_len)
    return TrainingInputs(store, config, training_identity(config), {"tokenized": store.put_table(table)})


def weights(store: ObjectStore, checkpoint_id: str) -> dict[str, torch.Tensor]:
    return store.get_tensors(read_manifest(store, checkpoint_id)["weights"])


def one_and_two_processes(trainer_class, one: TrainingInputs, two: TrainingInputs, segment_task=None, **options):
    """(1-process history, its final weights, 2-process history, its final weights, the initial weights), from step
    0 each. The 2 processes: through `segment_task(start checkpoint)` (the flow's task) when given."""
    single = trainer_class.initial(one, **options)
    single_checkpoint, single_history = train_segment(single, Segment(1, STEPS))
    start = trainer_class.initial(two, **options).checkpoint_id
    if segment_task is None:
        checkpoint, history = run_segment_in_processes(trainer_class, two, start, 1, STEPS, 2, **options)
    else:
        done = segment_task(start)
        checkpoint, history = done["checkpoint"], done["metrics"]
        assert two.store.get_ref(chain_ref(two.identity, two.data_ids, STEPS)) == checkpoint  # indexed
    return (single_history, weights(one.store, single_checkpoint), history, weights(two.store, checkpoint),
            weights(one.store, start))


def assert_same_training(single_history, single_weights, history, dp_weights, initial_weights, loss_key="loss"):
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    losses = torch.tensor([m[loss_key] for m in single_history], dtype=torch.float64)
    dp_losses = torch.tensor([m[loss_key] for m in history], dtype=torch.float64)
    assert torch.allclose(dp_losses, losses, rtol=LOSS_RTOL, atol=0), (losses.tolist(), dp_losses.tolist())
    assert single_weights.keys() == dp_weights.keys()
    moved = max((single_weights[n] - initial_weights[n]).abs().max().item() for n in single_weights)
    assert moved > 1e-3  # the weights did train, so agreeing means something
    worst = max((single_weights[n] - dp_weights[n]).abs().max().item() for n in single_weights)
    assert worst <= WEIGHT_ATOL, worst
    print(f"max loss diff {(dp_losses - losses).abs().max().item():.3g} "
          f"(relative {((dp_losses - losses).abs() / losses.abs()).max().item():.3g}), max weight diff {worst:.3g}, "
          f"weights moved up to {moved:.3g}")


# --- the step's arithmetic, in one process ----------------------------------------------------------------------


def test_share_is_round_robin_and_pads_ranks_with_empty_micro_batches(tmp_path):
    config = sft_config(str(tmp_path / "store"), 1, 3, 3)
    _, batches = sft_inputs(config)
    step = batches.for_step(1)
    assert step.num_rows == 3
    zero, one = DataParallelRank(0, 2).share(step), DataParallelRank(1, 2).share(step)
    assert zero["micro_batch_index"].to_pylist() == [step["micro_batch_index"][i].as_py() for i in (0, 2)]
    assert one.num_rows == 2 and one["input_ids"][0] == step["input_ids"][1]
    filler = one.slice(1, 1)
    assert filler["input_ids"][0] == step["input_ids"][0]  # it runs a real forward pass...
    assert not any(filler["loss_mask"][0].as_py())  # ...on which nothing trains
    for name in ("ce_weights", "rl_weights", "ref_kl_weights"):
        assert set(filler[name][0].as_py()) == {0.0}
    assert empty_micro_batch(step.slice(0, 1)).schema == wire.MICRO_BATCHES


def test_nproc_enters_the_identity_only_above_one(tmp_path):
    store = str(tmp_path / "store")
    one, two = sft_config(store, 1, 2, 1), sft_config(store, 2, 2, 1)
    assert "hardware" not in training_settings(one)  # nproc = 1: identities of existing runs unchanged
    assert training_settings(two)["hardware"] == {"nproc": 2}
    assert training_identity(one) != training_identity(two)


# --- 2 processes (gloo) against 1 ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_two_processes_train_what_one_trains(tmp_path):
    # 3 micro-batches a step: rank 0 trains two, rank 1 one and a filler.
    one, batches = sft_inputs(sft_config(str(tmp_path / "store"), 1, 3, 3))
    two, _ = sft_inputs(sft_config(str(tmp_path / "store"), 2, 3, 3))  # one store: the same tables, two chains
    _, micro_batches_id, plan_id = batches.ids

    def segment_task(start):  # the train-sft flow's task, as the flow calls it (its group closed with the run)
        with ResidentTrainer() as resident:
            return tasks.sft.train_segment_task.fn(two.config, two.data_ids["samples"], micro_batches_id, plan_id,
                                                   start, 1, STEPS, resident)

    single_history, single_weights, history, dp_weights, initial = one_and_two_processes(
        CausalLmTrainer, one, two, segment_task, batches=batches)
    assert [m["tokens/ce"] for m in history] == [m["tokens/ce"] for m in single_history]  # N_ce summed over ranks
    assert_same_training(single_history, single_weights, history, dp_weights, initial)
    assert history[0]["micro_batches"] == 3  # rank 1's filler ran, but is no micro-batch of the step


@pytest.mark.slow
def test_rm_two_processes_train_what_one_trains(tmp_path):
    # 3 pairs a step: rank 0 trains two, rank 1 one.
    one, two = rm_inputs(rm_config(str(tmp_path / "store"), 1)), rm_inputs(rm_config(str(tmp_path / "store"), 2))
    def segment_task(start):  # the train-rm flow's task, as the flow calls it (its group closed with the run)
        with ResidentTrainer() as resident:
            return tasks.rm.train_segment_task.fn(two.config, two.data_ids["tokenized"], start, 1, STEPS, resident)

    single_history, single_weights, history, dp_weights, initial = one_and_two_processes(
        RewardModelTrainer, one, two, segment_task)
    assert [m["pairs"] for m in history] == [3] * STEPS
    assert_same_training(single_history, single_weights, history, dp_weights, initial)
    for single, dp in zip(single_history, history):
        assert dp["accuracy"] == pytest.approx(single["accuracy"])
        assert dp["mean_margin"] == pytest.approx(single["mean_margin"], rel=1e-4, abs=1e-6)


@pytest.fixture(scope="module")
def one_group_three_segments(tmp_path_factory) -> dict:
    """Issue 44: the flow's tasks keep one group for the run (in its resident); its ranks keep the trainer between
    segments. 3 steps of 2 ranks at one micro-batch a step (minibatch 2, no accumulation: rank 1 gets nothing but
    fillers, every step), as the train-sft flow runs them: one one-step segment after another in one group
    (tasks.sft.train_segment_task). Then the same group is asked for checkpoints it does not hold (step 3, then 2,
    then 1): a torchrun per segment opened each segment's start from the store, and so do these ranks. Within 240 s,
    else a hang. The store, inputs and what happened, for the two tests below."""
    from rollout_lib import step_events
    from rollout_lib.trainer.segment_group import RESOURCE

    two, batches = sft_inputs(sft_config(str(tmp_path_factory.mktemp("one-group") / "store"), 2, 2, 1))
    _, micro_batches_id, plan_id = batches.ids
    start = CausalLmTrainer.initial(two, batches=batches).checkpoint_id

    def segments() -> dict:
        ends, history, published = [], [], []
        with ResidentTrainer() as resident, step_events.subscribed(lambda step, metrics: published.append(step)):
            checkpoint = start
            for step in range(1, STEPS + 1):  # the flow's segments, one step each, the trainer kept in the ranks
                done = tasks.sft.train_segment_task.fn(two.config, two.data_ids["samples"], micro_batches_id,
                                                       plan_id, checkpoint, step, step, resident)
                checkpoint = done["checkpoint"]
                ends.append(checkpoint)
                history.extend(done["metrics"])
            group = resident.resource(RESOURCE, lambda: None)
            # each from the store, as a torchrun per segment did (the ranks hold step 3, then 2, then 1)
            opened = [group.train(ends[0], 2, 2)[0], group.train(start, 1, 1)[0], group.train(ends[1], 3, 3)[0]]
            starts = group.starts
            ranks = group.ranks._process
        return {"two": two, "batches": batches, "start": start, "ends": ends, "history": history,
                "published": published, "opened": opened, "starts": starts, "returncode": ranks.returncode}

    return finished_within(240, "the data-parallel segments", segments)


@pytest.mark.slow
def test_a_run_of_three_segments_starts_torchrun_once_and_ends_where_a_torchrun_per_segment_ended(
        one_group_three_segments):
    """Issue 44: a run's segments in one group (one torchrun); asked for checkpoints they do not hold, its ranks
    open them from the store (the code a torchrun per segment ran), and write the same ids again."""
    run = one_group_three_segments
    assert run["starts"] == 1  # one torchrun for all six segments
    assert run["returncode"] == 0  # stopped cleanly with the run
    assert run["published"] == [1, 2, 3, 2, 1, 3]  # each step as it finished
    ends = run["ends"]
    assert run["opened"] == [ends[1], ends[0], ends[2]]


def finished_within(seconds: float, what: str, work):
    """`work()`'s result, run in a thread: fails the test if it has not returned after `seconds` (a hang), and
    re-raises what it raised."""
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert not thread.is_alive(), f"{what} hung"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@pytest.mark.slow
def test_a_rank_with_only_empty_micro_batches_does_not_hang(one_group_three_segments):
    """One micro-batch a step: rank 1 gets nothing but fillers, every step (the module's group, which had 240 s to
    finish its segments), and the 2 ranks train what one process trains."""
    run = one_group_three_segments
    two = run["two"]
    one, batches = sft_inputs(sft_config(two.store.root, 1, 2, 1))
    assert batches.ids[1:] == run["batches"].ids[1:]  # the same micro-batches and step plan (ids after the store)
    single = CausalLmTrainer.initial(one, batches=batches)
    single_checkpoint, single_history = train_segment(single, Segment(1, STEPS))
    assert_same_training(single_history, weights(one.store, single_checkpoint), run["history"],
                         weights(two.store, run["ends"][-1]), weights(two.store, run["start"]))


def _torchrun_summary(tmp_path, sigterm_error_time: int, sigkill_time: int) -> list[str]:
    """torchrun's own failure summary (its ChildFailedError) for rank 1 SIGKILLed and rank 0 then stopped by
    torchrun with SIGTERM (its error file written at `sigterm_error_time`)."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    callstack = "Traceback (most recent call last):\n  File \"w.py\", line 1\nSignalException: 15"
    error_file.write_text(json.dumps({"message": {"message": "SignalException: Process 12 got signal: 15",
                                                  "extraInfo": {"py_callstack": callstack,
                                                                "timestamp": str(sigterm_error_time)}}}))
    killed = ProcessFailure(local_rank=1, pid=13, exitcode=-9, error_file="<N/A>")
    killed.timestamp = sigkill_time
    stopped = ProcessFailure(local_rank=0, pid=12, exitcode=-15, error_file=str(error_file))
    return ChildFailedError("worker", {0: stopped, 1: killed}).format_msg().splitlines()


@pytest.mark.parametrize("sigterm_first", [True, False])
def test_the_failure_named_is_the_rank_that_died_not_the_one_torchrun_stopped(tmp_path, sigterm_first):
    """torchrun's "Root Cause" is the earliest failure at one-second resolution: the rank it SIGTERMed itself can
    come first (seen: "rank 0 exited with code -15"). The message names the SIGKILLed rank either way."""
    tail = _torchrun_summary(tmp_path, sigterm_error_time=100 if sigterm_first else 200, sigkill_time=150)
    assert ("rank      : 0" in tail[tail.index("Root Cause (first observed failure):") + 4]) == sigterm_first
    assert first_failure(tail)["rank"] == 1 and root_cause_rank(tail) == 1
    message = failure_message("train steps 2-2", 1, tail, "rerun")
    assert message.startswith("train steps 2-2: rank 1 exited with code -9 (Signal 9 (SIGKILL) received by PID 13)")
    assert first_failure(["no summary here"]) is None


def test_a_rank_that_aborts_is_named_with_what_it_printed_last():
    """A rank killed by a signal it raised itself (SIGABRT: a C++ `terminate called ...`) says why only in its own
    output, above torchrun's summary (which alone fills the last 20 lines): the message quotes those lines. The
    output is torchrun's, as it printed it for a rank that wrote this and called os.abort()."""
    agent = "E1127 21:26:11.133000 11183 torch/distributed/elastic/multiprocessing/api.py:1002]"
    tail = ["ROLLOUT step 3 starting", "terminate called after throwing an instance of 'c10::Error'",
            "  what():  something broke in C++",
            f"{agent} failed (exitcode: -6) local_rank: 0 (pid: 11200) of binary: /venv/bin/python",
            "Traceback (most recent call last):", '  File "torch/distributed/run.py", line 1032, in <module>',
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 54,
            "rollout_lib.trainer.segment_worker FAILED", "-" * 54, "Failures:", "  <NO_OTHER_FAILURES>", "-" * 54,
            "Root Cause (first observed failure):", "[0]:", "  time      : 2026-11-27_21:26:11",
            "  host      : localhost", "  rank      : 0 (local_rank: 0)", "  exitcode  : -6 (pid: 11200)  (SIGABRT)",
            "  error_file: <N/A>", "  traceback : Signal 6 (SIGABRT) received by PID 11200", "=" * 54]
    message = failure_message("train steps 3-3", 1, tail, "rerun").splitlines()[0]
    assert message == ("train steps 3-3: rank 0 exited with code -6 (Signal 6 (SIGABRT) received by PID 11200; its "
                       "last output: ROLLOUT step 3 starting | terminate called after throwing an instance of "
                       "'c10::Error' | what():  something broke in C++); rerun."), message
    # a SIGKILL says nothing of its own: the message stays torchrun's
    killed = [line.replace("-6", "-9").replace("6 (SIGABRT)", "9 (SIGKILL)") for line in tail]
    assert "last output" not in failure_message("train steps 3-3", 1, killed, "rerun").splitlines()[0]


# --- through the flow: `rollout train sft --nproc 2`, a rank SIGKILLed, the rerun ---------------------------------


@pytest.mark.slow
def test_sigkill_of_one_rank_fails_the_run_clearly_and_the_rerun_resumes(prefect_server, tmp_path):
    from clirun import run_rollout, task_run_states, train_in_process

    store = tmp_path / "store"
    steps = 2
    args = ["train", "sft", "--config", "configs/sft-tiny.toml", "--nproc", "2", "--set", f"run.store={store}",
            "--set", "algorithm.sft.gradient_accumulation=2", "--set", f"algorithm.sft.budget.max_steps={steps}",
            "--set", "algorithm.sft.checkpoint_interval=1", "--quiet"]
    killed = run_rollout(*args, **{KILL_RANK_ENV: "1:2"})  # rank 1 SIGKILLs itself as step 2 starts
    assert killed.returncode == 1, killed.stderr[-3000:]
    error = next(line for line in killed.stderr.splitlines() if line.startswith("rollout: error:"))
    assert "train steps 2-2: data-parallel segment (2 processes) failed: rank 1 exited with code -9" in error \
        and "SIGKILL" in error, error
    config = load_config(SftConfig, "configs/sft-tiny.toml", {  # what --nproc 2 and the --set options stand for
        "run.store": str(store), "algorithm.sft.gradient_accumulation": 2, "algorithm.sft.budget.max_steps": steps,
        "algorithm.sft.checkpoint_interval": 1, "algorithm.sft.hardware.nproc": 2})
    assert ObjectStore(str(store)).get_ref("runs/sft-tiny/latest") is None

    result = train_in_process(*args)  # the rerun: the flow in this process (the CLI's failure is what ran above)
    states = task_run_states(result["flow_run_id"])
    assert states["train-steps-1-1"] == "Cached", states  # the snapshot before the killed segment
    assert states["train-steps-2-2"] == "Completed"
    manifest = read_manifest(ObjectStore(str(store)), result["checkpoint"])
    assert manifest["step"] == steps and manifest["training_identity"] == training_identity(config)
    assert read_manifest(ObjectStore(str(store)), manifest["parent"])["step"] == 1


def test_nproc_flag_is_the_hardware_override():
    import click

    from rollout_cli.main import _shortcut_overrides
    from rollout_lib.config import RlConfig
    from rollout_lib.errors import ConfigError

    assert _shortcut_overrides("rm", None, None, None, 2) == ["algorithm.rm.hardware.nproc=2"]
    with click.Context(click.Command("train")), pytest.raises(click.UsageError, match="--nproc: rlhf"):
        _shortcut_overrides("rlhf", None, None, None, 2)
    assert _shortcut_overrides("rl", None, None, None, 2) == ["algorithm.rl.hardware.nproc=2"]
    rl = load_config(RlConfig, "configs/rl-tiny.toml", {"algorithm.rl.hardware.nproc": 2})
    assert rl.settings.hardware.nproc == 2
    with pytest.raises((ConfigError, ValueError), match="each process its own GPU"):
        load_config(SftConfig, "configs/sft-tiny.toml", {"algorithm.sft.hardware.nproc": 2,
                                                         "algorithm.sft.hardware.device": "cuda:0"})
