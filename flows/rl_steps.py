"""The steps of a train-rl run, as task runs: sample -> score -> advantages -> pack -> train (-> snapshot), and the
held-out evaluations between them. flows/train_rl.py owns the run; this is its loop body and the bookkeeping that
crosses steps.

- Weight sync: a sample stage (and an evaluation) starts by bringing its sampler to the state it samples from:
  train-step-k's weights published to the policy server, which reloads and probes them (tasks/rl.py,
  `synced_samplers`), then it samples. It is part of the sample task, not a task of its own: a rerun that finds the
  sample cached needs no weights, and one that reruns it needs them loaded whatever ran before.

- Which state step n samples from: the OffPolicySchedule (rl/schedule.py). With k > 0 the sampling of step n+k
  is a concurrent task run, submitted before step n trains; sample runs are chained one at a time, since the
  policy server holds one state (docs/serving.md, "Off-policy steps").
- On an engine at k = 0 the evaluation of state n runs beside step n+1's sample, score, advantages and pack
  stages: the policy server holds state n for both (one reload), and the engine batches both requests. It is waited
  for before step n+1 trains (it reads the trainer at state n); step n's record waits for it. Elsewhere an
  evaluation runs in line (after the samplings in flight: the server then reloads to the newest state).
- Scoring, one strategy picked once (`pick_scoring`): streamed (`reward_loop.streamed`, the default),
  sample-and-score-step-k scores each rollout as soon as it is sampled and score-merge-step-k puts those rewards
  into the table (off-policy, it also computes the behaviour logprobs as rollouts come in, and advantages-step-k
  adopts them: rl/behaviour_stream.py); staged, score-step-k scores them all after the last is sampled; chunked
  (`run.task_runner` of type dask or ray), score-step-k-chunk-i tasks on that cluster, then score-merge-step-k.
  With dynamic sampling (envs with `dynamic_sampling`), each replacement round runs the same way as task runs of
  its own, then dynamic-sampling-step-k keeps the groups with signal (flows/rl_rounds.py).
- Each recorded step feeds the collapse guard (rl/collapse.py): a collapse is one warning line of the flow run, or
  with `algorithm.rl.collapse.action = "fail"` the run's error.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prefect import Task, get_run_logger

from flows.common import TrainingRun, publish_step_samples
from rollout_lib import step_events
from rollout_lib.config import RlConfig
from rollout_lib.rl.collapse import CollapseGuard
from rollout_lib.rl.curriculum import initial_state
from rollout_lib.rl.schedule import OffPolicySchedule
from rollout_lib.runlog.eval_tables import record_rl_eval_tables
from rollout_lib.runlog.step_log import segment_means
from rollout_lib.runlog.step_tables import record_step_tables
from rollout_lib.rl.dynamic_sampling import resamples
from flows.rl_rounds import resampled_step
from tasks.common import open_store
from rollout_lib.trainer.segment import SnapshotSchedule
from tasks.rl import (
    RunResources,
    advantages_task,
    evaluate_task,
    load_eval_prompts_task,
    pack_task,
    sample_and_score_task,
    sample_task,
    score_chunk_task,
    score_merge_task,
    score_task,
    snapshot_task,
    train_step_task,
)
from tasks.rl_rounds import sample_and_score_round_task, sample_round_task, score_rewards_task

# Metrics shown per step in the UI table (and their column order); absent ones are left blank.
METRIC_COLUMNS = (
    "step", "reward_mean", "reward_std", "missing_rewards", "advantage_mean", "advantage_std",
    "zero_advantage_fraction", "trainable_samples", "loss", "loss/rl", "loss/ce", "loss/ref_kl", "rl/mismatch_kl",
    "ref_kl/kl",
    "rl/masked_fraction", "grad_norm", "lr", "tokens", "completion_len_mean", "sample_s", "score_s",
    "advantages_s", "pack_s", "train_s",
)
STAGE_TIMES = ("sample_s", "score_tail_s", "score_s", "advantages_s", "pack_s", "train_s")
# Columns only some runs have (multi-turn envs, reward models): in the table when a step reports them.
OPTIONAL_METRIC_COLUMNS = (
    "turns_mean", "env_token_fraction", "truncated_fraction", "sampled_entropy", "reward_model/scored",
    "reward_model/prompt_truncated", "reward_model/prompt_tokens_dropped", "reward_model/missing_too_long",
    "off_policy_lag", "behaviour/sampler_diff_max", "behaviour/sampler_kl", "score_tail_s",
    "behaviour/precomputed_rows", "behaviour/recompute_s", "behaviour/precompute_s", "behaviour/precompute_tail_s",
    "staleness_max", "partial/completed_samples", "partial/carried_samples", "partial/forced_groups",
)


@dataclass(frozen=True)
class Scoring:
    """How a step's rollouts get their rewards, picked once per run (`pick_scoring`): `sampling`, the step's sample
    task; `score(steps, sampled, step)`, the task runs that give the scored table (the same ids every way). For
    dynamic sampling's rounds (flows/rl_rounds.py): `sampling_round`, a replacement round's sample task, and
    `rewards(steps, sampled, step, round)`, the task runs that give a round's rewards (ids of results in row
    order)."""

    sampling: Task
    score: Callable[["RlSteps", dict, int], dict]
    sampling_round: Task
    rewards: Callable[["RlSteps", dict, int, int], list[str]]

    def resampled(self, steps: "RlSteps", sampled: dict, step: int) -> dict:
        """The step's sample result once its dynamic-sampling rounds ran: here, none run."""
        return sampled


class ResampledScoring(Scoring):
    """Scoring for a run whose envs replace their uniform groups (`dynamic_sampling`): after the step's sample
    stage, its replacement rounds as task runs of their own, then the kept rows, already scored
    (flows/rl_rounds.py)."""

    def resampled(self, steps: "RlSteps", sampled: dict, step: int) -> dict:
        return resampled_step(steps, sampled, step)


def _kept(steps: "RlSteps", sampled: dict, step: int) -> dict:  # dynamic-sampling-step-k scored the kept rows
    return sampled["scored"]


def _staged(steps: "RlSteps", sampled: dict, step: int) -> dict:  # score-step-k, after the last rollout is sampled
    return steps.run_task(score_task)(steps.cfg, steps.prompts, sampled["rollouts"], step, steps.res.reward_loops)


def _staged_rewards(steps: "RlSteps", sampled: dict, step: int, round_index: int) -> list[str]:
    return [steps.run_task(score_rewards_task)(steps.cfg, steps.prompts, sampled["rollouts"], step, round_index,
                                               steps.res.reward_loops)]


def _merged(steps: "RlSteps", sampled: dict, step: int) -> dict:  # score-merge-step-k: the rewards streamed in
    return steps.run_task(score_merge_task)(steps.cfg, sampled["rollouts"], step, [sampled["rewards"]])


def _streamed_rewards(steps: "RlSteps", sampled: dict, step: int, round_index: int) -> list[str]:
    return [sampled["rewards"]]  # scored as they were sampled


def _chunked(runner, steps: "RlSteps", sampled: dict, step: int) -> dict:
    """On the run's task runner (dask or ray): `score_chunks` score-step-k-chunk-i tasks submitted together, then
    score-merge-step-k, in row order: the table id and metrics score_task gives."""
    chunk_ids = _chunk_rewards(runner, steps, sampled, step, 0)
    return steps.run_task(score_merge_task)(steps.cfg, sampled["rollouts"], step, chunk_ids)


def _chunk_rewards(runner, steps: "RlSteps", sampled: dict, step: int, round_index: int) -> list[str]:
    """The ids of the chunks' results, in row order: `score_chunks` score-step-k[-round-r]-chunk-i tasks submitted
    together on the run's task runner."""
    chunks = steps.cfg.run.task_runner.score_chunks
    score_chunk = steps.run_task(score_chunk_task)
    futures = [runner.submit(score_chunk, {"config": steps.cfg, "prompts_ids": steps.prompts, "chunks": chunks,
                                           "rollouts_id": sampled["rollouts"], "step": step, "chunk": chunk,
                                           "round_index": round_index})
               for chunk in range(chunks)]
    return [future.result() for future in futures]  # a failed chunk raises its own error here


def pick_scoring(cfg: RlConfig, runner) -> Scoring:
    """Chunked on a dask or ray runner (a chunk is a task on another worker, which a sampling stage cannot feed as
    it goes), else streamed (`reward_loop.streamed`: sample-and-score-step-k scores each rollout as it comes back,
    rl/streamed.py) or staged; with dynamic sampling, the same with the step's rounds between its sample stage and
    its scored table (ResampledScoring)."""
    if runner is not None:
        scoring = Scoring(sample_task, functools.partial(_chunked, runner), sample_round_task,
                          functools.partial(_chunk_rewards, runner))
    # Partial rollouts: a stage's rows are final only when their groups are (rl/partial.py), scored after it.
    elif cfg.settings.reward_loop.streamed and cfg.settings.partial_rollouts is None:
        scoring = Scoring(sample_and_score_task, _merged, sample_and_score_round_task, _streamed_rewards)
    else:
        scoring = Scoring(sample_task, _staged, sample_round_task, _staged_rewards)
    if resamples(cfg):
        return ResampledScoring(scoring.sampling, _kept, scoring.sampling_round, scoring.rewards)
    return scoring


@dataclass
class PendingEvaluation:
    """Step `step`, trained and snapshotted, whose held-out evaluation runs beside the next step (on an engine at
    k = 0: the policy server holds state `step` for both). It is recorded (`RlSteps._finish`) once `evaluating` is
    done, before the next step trains, or when the steps stop, if it finished."""

    step: int
    metrics: dict
    checkpoint: str | None
    evaluating: list = field(default_factory=list)  # evaluate_task futures


class RlSteps:
    def __init__(self, run: TrainingRun, schedule: OffPolicySchedule, prompts: dict[str, str], initial: str,
                 resources: RunResources, runner=None):
        self.cfg, self.run_task, self.progress, self.curves = run.cfg, run.tasks, run.progress, run.curves
        self.schedule, self.prompts, self.res = schedule, prompts, resources
        cfg, settings = run.cfg, run.cfg.settings
        self.total = settings.budget.max_steps
        self.snapshots = SnapshotSchedule(settings.checkpoint_interval, self.total)
        self.scoring = pick_scoring(cfg, runner)
        self.logger = get_run_logger()
        self.state = self.checkpoint = initial
        self.states = {0: initial}  # step -> the policy state after it
        # step -> the difficulty pools after it (envs with `curriculum`; rl/curriculum.py), fed back like states
        self.pools = {0: open_store(cfg).put_json(initial_state())} if any(env.curriculum for env in settings.envs) \
            else None
        self.evaluations = {env.name: run.tasks(load_eval_prompts_task)(cfg, env.name)["prompts"]
                            for env in settings.envs if env.eval is not None}
        self.overlap_evaluation = schedule.synchronous and settings.policy_sampler.type != "hf"
        self.in_flight: dict = {}  # off-policy runs: step -> its sample task's future
        # Partial rollouts: step -> the id of the requests its sample stage carried on (None: none), rl/partial.py
        self.carried: dict[int, str | None] = {0: None}
        self.pending: PendingEvaluation | None = None
        self.history: list[dict] = []
        self.collapse_guard = CollapseGuard(settings.collapse)
        self.collapses: list[str] = []  # the lines the guard said (action "warn"), for the run's summary
        self.segment_first = 1  # the first step after the last snapshot: its log line quotes the segment's means
        for ahead in schedule.first_submissions(self.total):
            self._submit_sampling(ahead)

    # --- one step -----------------------------------------------------------------------------------------------

    def run(self, step: int) -> None:
        cfg, task, sampled_from = self.cfg, self.run_task, self.states[self.schedule.sampled_after(step)]
        inputs = {"prompts_ids": self.prompts, "step": step, "resources": self.res}  # every stage's named inputs
        if self.schedule.synchronous:
            sampling, arguments = self._sampling(step)
            sampled = sampling(cfg, **arguments)
        else:
            sampled = self.in_flight.pop(step).result()
        self.carried[step] = sampled.get("in_flight")
        # Dynamic sampling's rounds sample this step's state: before the next sample stage is submitted (the sample
        # runs are chained anyway: submitting it earlier would not start it earlier).
        sampled = self.scoring.resampled(self, sampled, step)
        if not self.schedule.synchronous:
            ahead = self.schedule.submitted_while_training(step, self.total)
            if ahead is not None:
                self._submit_sampling(ahead)  # from states[step - 1]: sampled while this step trains
        scored = self.scoring.score(self, sampled, step)
        samples = task(advantages_task)(cfg, **inputs, policy_state=sampled_from, scored_id=scored["rollouts"],
                                        curriculum=None if self.pools is None else self.pools[step - 1],
                                        behaviour=sampled.get("behaviour"))
        if self.pools is not None:
            self.pools[step] = samples["curriculum"]
        packed = task(pack_task)(cfg, samples["samples"], step)
        step_metrics = {**sampled["metrics"], **scored["metrics"], **samples["metrics"], **packed["metrics"]}
        if self.pending is not None:  # the evaluation beside this step is waited for: it reads the state before
            self._finish_pending()
        trained = task(train_step_task)(cfg, **inputs, policy_state=self.state,
                                        micro_batches_id=packed["micro_batches"])
        # Where this step's tables are, for `rollout runs samples` (runlog/step_tables.py): before the state moves.
        record_step_tables(open_store(cfg), cfg.run.name, step, {
            "prompts": self.prompts, "rollouts": sampled["rollouts"], "scored": scored["rollouts"],
            "rewards": sampled.get("rewards"), "samples": samples["samples"],
            "micro_batches": packed["micro_batches"], "sampled_from_state": sampled_from, "state": trained["state"]})
        publish_step_samples(cfg, step)
        self.state = self.states[step] = trained["state"]
        checkpoint = None
        if self.snapshots.takes(step):
            checkpoint = self.checkpoint = task(snapshot_task)(
                cfg, **inputs, policy_state=self.state, step_metrics={**step_metrics, **trained["metrics"]})
        # Policy versions between the state that sampled the step's tokens and the state trained (0 on-policy).
        metrics = {**step_metrics, **trained["metrics"], "step": step}
        if cfg.settings.partial_rollouts is None:  # partial rollouts measure their tokens' own (rl/partial.py)
            metrics["staleness_mean"] = self.schedule.lag(step)
        if not self.schedule.synchronous:  # optimizer steps between the weights that sampled and those trained
            metrics["off_policy_lag"] = self.schedule.lag(step)
        if self.overlap_evaluation and step < self.total and self._due(step):
            self.pending = PendingEvaluation(step, metrics, checkpoint, self._submit_evaluations(step))
        else:
            self._finish(step, {**metrics, **self.evaluate(step)}, checkpoint)

    @contextlib.contextmanager
    def in_flight_waited(self) -> Iterator[None]:
        """Around the steps: whatever happens, never leave (and stop the servers under) a sampling or evaluation
        task still running; a step whose evaluation finished keeps its record even if the step after it failed."""
        try:
            yield
        finally:
            evaluating = self.pending.evaluating if self.pending else ()
            for future in [*self.in_flight.values(), *evaluating]:
                future.wait()
            if self.pending is not None and all(future.state.is_completed() for future in evaluating):
                self._finish_pending()

    # --- evaluation ---------------------------------------------------------------------------------------------

    def evaluate(self, step: int) -> dict:
        """Held-out metrics of the policy now (`self.state`) for the envs whose evaluation is due at `step`."""
        results = []
        for env in self._due(step):
            self.wait_for_samplings()  # a policy server holds one state at a time: the evaluation's, next
            results.append(self.run_task(evaluate_task)(self.cfg, **self._evaluation(env, step)))
        return self._held_out(step, results)

    def wait_for_samplings(self) -> None:
        """Wait for the sample stages in flight (off-policy): before anything else samples from another state."""
        for future in self.in_flight.values():
            future.wait()

    def _held_out(self, step: int, results: list[dict]) -> dict:
        """The evaluations' metrics at `step`, their samples recorded where `rollout runs samples --eval` reads them
        (runlog/eval_tables.py)."""
        if results:
            record_rl_eval_tables(open_store(self.cfg), self.cfg.run.name, step, {
                result["env"]: {"scored": result["scored"], "rewards": result["rewards"],
                                "prompts": self.evaluations[result["env"]]} for result in results})
        return {name: value for result in results for name, value in result["metrics"].items()}

    def _due(self, step: int) -> list[str]:
        return [env.name for env in self.cfg.settings.envs if env.name in self.evaluations
                and (step % env.eval.every == 0 or step in (0, self.total))]

    def _evaluation(self, env: str, step: int) -> dict:
        return {"prompts_ids": self.prompts, "eval_prompts_id": self.evaluations[env], "env": env,
                "policy_state": self.state, "step": step, "resources": self.res}

    def _submit_evaluations(self, step: int) -> list:
        return [self.run_task(evaluate_task).submit(self.cfg, **self._evaluation(env, step)) for env in self._due(step)]

    # --- bookkeeping --------------------------------------------------------------------------------------------

    def _finish_pending(self) -> None:
        pending, self.pending = self.pending, None
        self._finish(pending.step, {**pending.metrics, **self._held_out(
            pending.step, [future.result() for future in pending.evaluating])}, pending.checkpoint)

    def _finish(self, step: int, metrics: dict, checkpoint: str | None) -> None:
        """Record step `step` with its held-out metrics: the metrics file and UI table, the log line, the progress
        and, at a snapshot, the segment's line and the curves."""
        self.history.append(metrics)
        step_events.publish(step, metrics)
        # A step the finite-gradient guard skipped has no finite loss (trainer/nonfinite.py).
        loss = "skipped (non-finite)" if metrics.get("skipped_nonfinite") else f"{metrics['loss']:.4f}"
        self.logger.info("step %d: reward %.3f (std %.3f, %d missing), loss %s, %s", step, metrics["reward_mean"],
                         metrics["reward_std"], metrics["missing_rewards"], loss,
                         " ".join(f"{name[:-2]} {metrics[name]:.2f}s" for name in STAGE_TIMES if name in metrics))
        if checkpoint:  # the segment's line, as train-rm's and train-sft's: one step's reward is a few prompts' worth
            segment = [m for m in self.history if m["step"] >= self.segment_first]
            means = segment_means(segment, ("reward_mean", "loss"))
            self.logger.info("steps %d-%d: mean reward %.3f, mean loss %.4f -> checkpoint %s", self.segment_first,
                             step, means["reward_mean"], means["loss"], checkpoint[:12])
            self.segment_first = step + 1
        self.progress.update(step)
        if checkpoint:
            self.curves.update()
        # Last: a collapse the step completes is one warning line, or under action "fail" the run's error, with the
        # step recorded (rl/collapse.py).
        collapse = self.collapse_guard.check(metrics)
        if collapse is not None:
            self.logger.warning("%s", collapse)
            self.collapses.append(collapse)

    def _sampling(self, step: int) -> tuple:
        """Step `step`'s sample task (the scoring's: sample, or sample-and-score) and its named inputs."""
        arguments = {
            "prompts_ids": self.prompts, "policy_state": self.states[self.schedule.sampled_after(step)],
            "step": step, "resources": self.res,
            "curriculum": None if self.pools is None else self.pools[self.schedule.sampled_after(step)]}
        if self.cfg.settings.partial_rollouts is not None:
            arguments.update(in_flight=self._carried_into(step), final=step == self.total)
        return self.run_task(self.scoring.sampling), arguments

    def _carried_into(self, step: int) -> str | None:
        """Partial rollouts: the requests the stage of step `step - 1` carried on. Its stage is waited for if it is
        still sampling (it is the one before in the chain of sample runs anyway; with k >= 2 the submission of step
        n+k then waits for step n+k-1's stage, docs/algorithms.md "Partial rollouts")."""
        if step - 1 not in self.carried:
            self.carried[step - 1] = self.in_flight[step - 1].result().get("in_flight")
        return self.carried[step - 1]

    def _submit_sampling(self, step: int) -> None:
        before = [self.in_flight[step - 1]] if step - 1 in self.in_flight else None
        sampling, arguments = self._sampling(step)
        self.in_flight[step] = sampling.submit(self.cfg, **arguments, wait_for=before)
