"""An RL run in-process through the library's stages (sample, score, advantages, pack, train step; no Prefect), for
tests that measure learning: the mean reward per step, and the last step's scored rollouts."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rollout_lib.config import RlConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.rl.advantages import training_samples
from rollout_lib.rl.pack import pack
from rollout_lib.rl.policy import initial_policy, policy_at, policy_inputs, train_policy_step
from rollout_lib.rl.prompts import load_prompts
from rollout_lib.rl.sample import build_samplers, sample_rollouts
from rollout_lib.rl.score import run_reward_loops, score_rollouts
from rollout_lib.store import ObjectStore
from rollout_lib.trainer.resident import ResidentTrainer

ROOT = Path(__file__).resolve().parent.parent


def reward_curve_in_process(config_name: str, overrides: list[str], steps: int) -> tuple[list[float], pa.Table]:
    """configs/<config_name> with `overrides`, in an in-memory store of its own, for `steps` steps."""
    cfg = load_config(RlConfig, ROOT / "configs" / config_name, [f"run.store=memory://learn-{config_name}",
                                                                 *overrides])
    store = ObjectStore(cfg.run.store)
    prompts = {env.name: load_prompts(env) for env in cfg.settings.envs}
    run = policy_inputs(store, cfg, {name: store.put_table(table) for name, table in prompts.items()})
    curve = []
    with ResidentTrainer() as resident, run_reward_loops(cfg) as reward_loops:
        state = initial_policy(run, resident)
        for step in range(1, steps + 1):
            policy = policy_at(run, state, resident)
            rollouts, _ = sample_rollouts(cfg, build_samplers(cfg, policy.model, policy.tokenizer), prompts, step)
            scored, reward_metrics = score_rollouts(cfg, rollouts, prompts, reward_loops)
            samples, _ = training_samples(cfg, scored)
            micro_batches, _ = pack(cfg, samples)
            state, _ = train_policy_step(run, state, step, store.put_table(micro_batches), resident)
            curve.append(round(reward_metrics["reward_mean"], 3))
    return curve, scored
