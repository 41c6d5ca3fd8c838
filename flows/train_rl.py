"""train-rl: on-policy RL, as the procedure you would write by hand.

[connect frozen models] -> load prompts per env -> init policy ->
    [sample -> score -> assign advantages -> pack -> train step (-> snapshot every N steps)] per step (rl_steps.py)

Unlike train-rm and train-sft, a task covers one step's stage: each step samples from the weights the step before
produced, and sampling and scoring are heavy enough that a task per stage costs little (bench/bench_rl_stages.py).
With `max_off_policy_steps = k > 0`, step n samples from the weights after step n-1-k, in a sample task submitted
to run beside the training of the steps before it (docs/serving.md, "Off-policy steps"). With `run.task_runner` of
type dask or ray, a step's scoring fans out to that cluster in chunks (docs/hardware.md, "Task runners"). With
`hardware.nproc = N > 1` (per node, on `hardware.nnodes` nodes) the train steps run data-parallel in the N x nnodes
processes kept for the run (rl/policy_group.py).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger

from flows.common import (
    fan_out_runner,
    flow_run_name,
    flow_run_page,
    recorded_run,
    start_run,
)
from flows.rl_steps import METRIC_COLUMNS, OPTIONAL_METRIC_COLUMNS, RlSteps
from rollout_lib.config import RlConfig
from rollout_lib.plan_checks import plan_warnings
from rollout_lib.rl.schedule import OffPolicySchedule
from rollout_lib.rl.score import run_reward_loops
from rollout_lib.serving.served import ServedModels
from rollout_lib.trainer.resident import ResidentTrainer
from tasks.rl import RunResources, connect_frozen_models_task, init_policy_task, load_prompts_task

@flow(name="train-rl", flow_run_name=flow_run_name, log_prints=True)
def train_rl(config: str = "configs/rl-tiny.toml", overrides: list[str] | dict[str, Any] | None = None,
             max_steps: int | None = None) -> dict:
    """On-policy RL of a causal LM. `overrides`: ["key.path=value", ...] or {"key.path": value}; `max_steps` is a
    shortcut for algorithm.rl.budget.max_steps."""
    logger = get_run_logger()
    run = start_run("train-rl", RlConfig, config, overrides, max_steps, "algorithm.rl.budget.max_steps")
    cfg, run_task = run.cfg, run.tasks
    for locator, message in plan_warnings(cfg):
        logger.warning("%s: %s", locator, message)
    total = cfg.settings.budget.max_steps
    schedule = OffPolicySchedule(cfg.settings.max_off_policy_steps)
    with ResidentTrainer(frozen_capacity=schedule.frozen_capacity) as resident, \
            ServedModels(cfg.run.store) as served_models, \
            run_reward_loops(cfg, served_models) as reward_loops, fan_out_runner(cfg.run.task_runner) as runner, \
            recorded_run(cfg, total, log_steps=False, samples=True) as recorder:
        if cfg.frozen_models() or cfg.served_reward_models():
            for connected in connect_frozen_models_task(cfg, served_models, reward_loops):
                logger.info("frozen model %s", connected)
        prompts = {env.name: run_task(load_prompts_task)(cfg, env.name)["prompts"] for env in cfg.settings.envs}
        initial = run_task(init_policy_task)(cfg, prompts, resident)["checkpoint"]
        steps = RlSteps(run, schedule, prompts, initial, RunResources(resident, served_models, reward_loops), runner)
        eval_before = steps.evaluate(0)
        _log_held_out(logger, "before", eval_before)
        recorder.annotate(0, eval_before)  # step 0 of the metrics file: the evaluation alone
        started = time.perf_counter()
        with steps.in_flight_waited():
            for step in range(1, total + 1):
                steps.run(step)
        train_seconds = time.perf_counter() - started
        _log_held_out(logger, "after", steps.history[-1])  # the last step's evaluation (always due)
        recorder.finish(steps.checkpoint, flow_run_page())  # the trackers' summary

    checkpoint, history = steps.checkpoint, steps.history
    optional = tuple(name for name in OPTIONAL_METRIC_COLUMNS if any(name in m for m in history))
    optional += tuple(sorted({name for m in history for name in m
                              if name.startswith(("eval/", "reward/", "curriculum/")) and not name.endswith("eval_s")}))
    eval_curves = {name: [[0, value]] + [[m["step"], m[name]] for m in history if name in m]
                   for name, value in eval_before.items() if name.endswith(("/reward_mean", "/pass_rate"))}
    return run.finish(checkpoint, history, METRIC_COLUMNS + optional,
                      _summary(cfg, checkpoint, history, eval_before, steps.collapses), {
                          "reward_curve": [m["reward_mean"] for m in history], "eval_curves": eval_curves,
                          "last_metrics": history[-1], "train_seconds": train_seconds})


def _log_held_out(logger, when: str, metrics: dict) -> None:
    for name, value in metrics.items():
        if name.startswith("eval/") and name.endswith("/reward_mean") and value is not None:
            logger.info("held-out %s training: %s %.3f", when, name, value)


def _summary(cfg: RlConfig, checkpoint: str, history: list[dict], eval_before: dict, collapses: list[str]) -> str:
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
        *(f"- **warning**: {line}" for line in collapses),
    ])
