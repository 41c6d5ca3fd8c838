"""train-rl: on-policy RL, as the procedure you would write by hand.

[connect frozen models] -> load prompts per env -> init policy ->
    [sample -> score -> assign advantages -> pack -> train step (a snapshot every N steps)] per step

Unlike train-rm and train-sft, a task covers one step's stage: each step samples from the weights the step before
produced, and sampling and scoring are heavy enough that a task per stage costs little (bench/bench_rl_stages.py).
With `max_off_policy_steps = k > 0`, step n samples from the weights after step n-1-k, in a sample task submitted
to run beside the training of the steps before it (docs/serving.md, "Off-policy steps"). With `run.task_runner` of
type dask or ray, a step's scoring fans out to that cluster in chunks (docs/hardware.md, "Task runners"). With
`hardware.nproc = N > 1` the train steps run data-parallel in N processes kept for the run (rl/policy_group.py).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.common import (
    CurvesArtifact,
    Progress,
    RunTasks,
    artifact_key,
    fan_out_runner,
    load_run_config,
    metrics_table,
    recorded_run,
)
from rollout_lib import step_events
from rollout_lib.config import RlConfig
from rollout_lib.rl.curriculum import initial_state
from rollout_lib.rl.schedule import OffPolicySchedule
from rollout_lib.rl.score import RewardLoops
from rollout_lib.serving.frozen import FrozenModels
from rollout_lib.trainer.identity import training_identity
from rollout_lib.trainer.resident import ResidentTrainer
from tasks.common import open_store
from tasks.rl import (
    advantages_task,
    connect_frozen_models_task,
    evaluate_task,
    init_policy_task,
    load_eval_prompts_task,
    load_prompts_task,
    pack_task,
    sample_task,
    score_chunk_task,
    score_merge_task,
    score_task,
    snapshot_task,
    train_step_task,
)

# Metrics shown per step in the UI table (and their column order); absent ones are left blank.
METRIC_COLUMNS = (
    "step", "reward_mean", "reward_std", "missing_rewards", "advantage_mean", "advantage_std",
    "zero_advantage_fraction", "trainable_samples", "loss", "loss/rl", "loss/ce", "loss/ref_kl", "rl/mismatch_kl",
    "ref_kl/kl",
    "rl/masked_fraction", "grad_norm", "lr", "tokens", "completion_len_mean", "sample_s", "score_s",
    "advantages_s", "pack_s", "train_s",
)
STAGE_TIMES = ("sample_s", "score_s", "advantages_s", "pack_s", "train_s")
# Columns only some runs have (multi-turn envs, reward models): in the table when a step reports them.
OPTIONAL_METRIC_COLUMNS = (
    "turns_mean", "env_token_fraction", "truncated_fraction", "reward_model/scored", "reward_model/prompt_truncated",
    "reward_model/prompt_tokens_dropped", "reward_model/missing_too_long", "off_policy_lag",
    "behaviour/sampler_diff_max", "behaviour/sampler_kl",
)


@flow(name="train-rl", log_prints=True)
def train_rl(config: str = "configs/rl-tiny.toml", overrides: list[str] | dict[str, Any] | None = None,
             max_steps: int | None = None) -> dict:
    """On-policy RL of a causal LM. `overrides`: ["key.path=value", ...] or {"key.path": value}; `max_steps` is a
    shortcut for algorithm.rl.budget.max_steps."""
    logger = get_run_logger()
    cfg = load_run_config(RlConfig, config, overrides, max_steps, "algorithm.rl.budget.max_steps")
    open_store(cfg).claim_run(cfg.run.name, training_identity(cfg))  # a run name holds one training, never two
    settings = cfg.settings
    for locator, message in cfg.plan_warnings():
        logger.warning("%s: %s", locator, message)
    run_task = RunTasks(cfg)
    sample, score, advantages = run_task(sample_task), run_task(score_task), run_task(advantages_task)
    pack, train_step = run_task(pack_task), run_task(train_step_task)

    total = settings.budget.max_steps
    progress = Progress(artifact_key(cfg.run.name, "progress"), total, f"train-rl {cfg.run.name}: steps done")
    history: list[dict] = []
    curves = CurvesArtifact(cfg, "train-rl")
    schedule = OffPolicySchedule(settings.max_off_policy_steps)
    with ResidentTrainer(frozen_capacity=schedule.frozen_capacity) as resident, \
            FrozenModels(cfg.run.store) as frozen_models, \
            RewardLoops(cfg, frozen_models) as reward_loops, fan_out_runner(cfg.run.task_runner) as runner, \
            recorded_run(cfg, total, log_steps=False):
        if cfg.frozen_models() or cfg.served_reward_models():
            for connected in connect_frozen_models_task(cfg, frozen_models, reward_loops):
                logger.info("frozen model %s", connected)
        prompts = {env.name: run_task(load_prompts_task)(cfg, env.name)["prompts"] for env in settings.envs}
        state = checkpoint = run_task(init_policy_task)(cfg, prompts, resident)["checkpoint"]
        evaluations = {env.name: run_task(load_eval_prompts_task)(cfg, env.name)["prompts"]
                       for env in settings.envs if env.eval is not None}

        in_flight: dict = {}  # off-policy runs: step -> its sample task's future (below)

        def due(step: int) -> list[str]:
            return [env.name for env in settings.envs
                    if env.name in evaluations and (step % env.eval.every == 0 or step in (0, total))]

        def evaluate(step: int) -> dict:
            """Held-out metrics of the policy now (`state`) for the envs whose evaluation is due at `step`."""
            found = {}
            for env in due(step):
                for future in in_flight.values():
                    future.wait()  # a policy server holds one state at a time: the evaluation's, next
                found.update(run_task(evaluate_task)(cfg, prompts, evaluations[env], env, state, step, resident,
                                                     reward_loops)["metrics"])
            return found

        # On an engine at k = 0 the evaluation of state n runs beside step n+1's sample, score, advantages and pack
        # stages: the policy server holds state n for both (one reload), and the engine batches both requests. It
        # is waited for before step n+1 trains (it reads the trainer at state n), and step n's record with it.
        overlap_evaluation = schedule.synchronous and settings.policy_sampler.type != "hf"

        def submit_evaluations(step: int) -> list:
            return [run_task(evaluate_task).submit(cfg, prompts, evaluations[env], env, state, step, resident,
                                                   reward_loops) for env in due(step)]

        def finish(step: int, metrics: dict, checkpoint: str | None, evaluating: list = ()) -> None:
            """Record step `step`: its held-out metrics (from `evaluating`, when they ran beside the next step),
            the metrics file and UI table, the log line, the progress and (at a snapshot) the curves."""
            for future in evaluating:
                metrics.update(future.result()["metrics"])
            history.append(metrics)
            step_events.publish(step, metrics)
            logger.info("step %d: reward %.3f (std %.3f, %d missing), loss %.4f, %s%s", step,
                        metrics["reward_mean"], metrics["reward_std"], metrics["missing_rewards"], metrics["loss"],
                        " ".join(f"{name[:-2]} {metrics[name]:.2f}s" for name in STAGE_TIMES if name in metrics),
                        f" -> checkpoint {checkpoint}" if checkpoint else "")
            progress.update(step)
            if checkpoint:
                curves.update()

        eval_before = evaluate(0)
        for name, value in eval_before.items():
            if name.endswith("/reward_mean"):
                logger.info("held-out before training: %s %.3f", name, value)
        # Off-policy steps (k > 0): step m samples from the state after step m-1-k (rl/schedule.py), so the sampling
        # of step n+k is submitted (a concurrent task run) before step n trains; sample runs are chained, one at a
        # time, since the policy server holds one state. k = 0: each step samples from the state before it.
        states = {0: state}  # step -> the policy state after it
        # step -> the difficulty pools after it (envs with `curriculum`; rl/curriculum.py), fed back like states
        pools = {0: open_store(cfg).put_json(initial_state())} if any(env.curriculum for env in settings.envs) \
            else None

        def sampling_pools(step: int) -> str | None:
            return None if pools is None else pools[schedule.sampled_after(step)]

        def submit_sampling(step: int) -> None:
            before = [in_flight[step - 1]] if step - 1 in in_flight else None
            in_flight[step] = sample.submit(cfg, prompts, states[schedule.sampled_after(step)], step, resident,
                                            frozen_models, sampling_pools(step), wait_for=before)

        for ahead in schedule.first_submissions(total):
            submit_sampling(ahead)
        started = time.perf_counter()
        unfinished = None  # (finish's arguments) of the step whose evaluation runs beside this one
        try:
            for step in range(1, total + 1):
                if schedule.synchronous:
                    sampled = sample(cfg, prompts, state, step, resident, frozen_models, sampling_pools(step))
                else:
                    ahead = schedule.submitted_while_training(step, total)
                    if ahead is not None:
                        submit_sampling(ahead)  # from states[step - 1]: sampled while this step trains
                    sampled = in_flight.pop(step).result()
                if runner is None:
                    scored = score(cfg, prompts, sampled["rollouts"], step, reward_loops)
                else:
                    scored = score_in_chunks(run_task, runner, cfg, prompts, sampled["rollouts"], step)
                samples = advantages(cfg, prompts, states[schedule.sampled_after(step)], scored["rollouts"], step,
                                     resident, frozen_models, None if pools is None else pools[step - 1])
                if pools is not None:
                    pools[step] = samples["curriculum"]
                packed = pack(cfg, samples["samples"], step)
                step_metrics = {**sampled["metrics"], **scored["metrics"], **samples["metrics"], **packed["metrics"]}
                if unfinished is not None:
                    finish(*unfinished)
                    unfinished = None
                trained = train_step(cfg, prompts, state, packed["micro_batches"], step, resident)
                state = states[step] = trained["state"]
                snapshot = step % settings.checkpoint_interval == 0 or step == total
                if snapshot:
                    checkpoint = run_task(snapshot_task)(cfg, prompts, state, step,
                                                         {**step_metrics, **trained["metrics"]}, resident)
                metrics = {**step_metrics, **trained["metrics"], "step": step}
                if not schedule.synchronous:  # optimizer steps between the weights that sampled and those trained
                    metrics["off_policy_lag"] = schedule.lag(step)
                if overlap_evaluation and step < total and due(step):
                    unfinished = (step, metrics, checkpoint if snapshot else None, submit_evaluations(step))
                else:
                    finish(step, {**metrics, **evaluate(step)}, checkpoint if snapshot else None)
        finally:
            for future in [*in_flight.values(), *(unfinished[3] if unfinished else ())]:
                future.wait()  # never stop the servers under a sampling or evaluation task still running
            if unfinished is not None and all(future.state.is_completed() for future in unfinished[3]):
                finish(*unfinished)  # a step after it failed: its own record is still written
        train_seconds = time.perf_counter() - started

    open_store(cfg).set_ref(f"runs/{cfg.run.name}/latest", checkpoint)
    optional = tuple(name for name in OPTIONAL_METRIC_COLUMNS if any(name in m for m in history))
    optional += tuple(sorted({name for m in history for name in m
                              if name.startswith(("eval/", "reward/", "curriculum/")) and not name.endswith("eval_s")}))
    metrics_table(cfg, "train-rl", history, METRIC_COLUMNS + optional)
    curves.update(final=True)
    create_markdown_artifact(_summary(cfg, checkpoint, history, eval_before),
                             key=artifact_key(cfg.run.name, "summary"), description="train-rl summary")
    logger.info("final checkpoint %s", checkpoint)
    rewards = [m["reward_mean"] for m in history]
    eval_curves = {name: [[0, value]] + [[m["step"], m[name]] for m in history if name in m]
                   for name, value in eval_before.items() if name.endswith(("/reward_mean", "/pass_rate"))}
    return {"checkpoint": checkpoint, "steps": total, "reward_curve": rewards, "eval_curves": eval_curves,
            "last_metrics": history[-1], "train_seconds": train_seconds}


def score_in_chunks(run_task: RunTasks, runner, cfg: RlConfig, prompts: dict[str, str], rollouts_id: str,
                    step: int) -> dict:
    """A step's scoring on the run's task runner (`run.task_runner`, type dask or ray): its rollouts in
    `chunks` score-chunk tasks submitted together, then merged in row order here (score_merge_task): the result
    score_task gives, table id and metrics alike."""
    chunks = cfg.run.task_runner.score_chunks
    score_chunk = run_task(score_chunk_task)
    futures = [runner.submit(score_chunk, {"config": cfg, "prompts_ids": prompts, "rollouts_id": rollouts_id,
                                           "step": step, "chunk": chunk, "chunks": chunks})
               for chunk in range(chunks)]
    chunk_ids = [future.result() for future in futures]  # a failed chunk raises its own error here
    return run_task(score_merge_task)(cfg, rollouts_id, step, chunk_ids)


def _summary(cfg: RlConfig, checkpoint: str, history: list[dict], eval_before: dict) -> str:
    settings = cfg.settings
    first, last = history[0], history[-1]
    window = max(1, min(5, len(history) // 2))
    head = sum(m["reward_mean"] for m in history[:window]) / window
    tail = sum(m["reward_mean"] for m in history[-window:]) / window
    envs = ", ".join(f"`{env.name}` ({env.algo.type}, {env.source.type}, group {env.sampling.group_size})"
                     for env in settings.envs)
    return "\n".join([
        f"# train-rl `{cfg.run.name}`",
        "",
        f"- final checkpoint: `{checkpoint}`",
        f"- store: `{cfg.run.store}`",
        f"- policy: `{settings.base_model.uri}`, steps: {settings.budget.max_steps}",
        f"- envs: {envs}",
        f"- mean reward: step 1 {first['reward_mean']:.3f} -> step {last['step']} {last['reward_mean']:.3f} "
        f"(first {window} steps {head:.3f}, last {window} steps {tail:.3f})",
        *(f"- held-out `{name}`: before {value:.3f} -> step {last['step']} {last[name]:.3f}"
          for name, value in eval_before.items()
          if name.endswith(("/reward_mean", "/pass_rate")) and value is not None and last.get(name) is not None),
    ])
