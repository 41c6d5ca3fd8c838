"""A step's DAPO dynamic sampling rounds as task runs (tasks/rl_rounds.py; rollout_lib/rl/dynamic_sampling.py
decides which groups are uniform, what each round draws and what the step keeps).

After the step's sample stage and its rewards (round 0), draw-step-k-round-1 draws the replacement prompts from
round 0's rows and rewards; round 1 is sampled and scored the run's way (the Scoring's `sampling_round` and
`rewards`: streamed, staged or chunked); draw-step-k-round-2 draws after rounds 0 and 1, and so on until a draw
finds nothing to draw; then dynamic-sampling-step-k keeps the groups with signal. Every task's key holds the ids of
the rounds before it, so a rerun returns the rounds a killed run finished from cache and goes on from the first it
did not.

Off-policy, the step's rounds sample from the state its first draw sampled from while later steps' sample stages
may be in flight: a round waits for those first (a policy server holds one state at a time), as an evaluation does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.rl_rounds import draw_round_task, kept_rows_task

if TYPE_CHECKING:
    from flows.rl_steps import RlSteps


def resampled_step(steps: RlSteps, sampled: dict, step: int) -> tuple[dict, dict]:
    """Step `step`'s rounds after its sample stage's result `sampled`: the kept rows as the step's sampled result
    (table, rewards, metrics: the first draw's, with the kept rows' and `dynamic_sampling/*` over them) and its
    scored result (table and metrics)."""
    scoring, task, cfg = steps.scoring, steps.run_task, steps.cfg
    sampled_from = steps.states[steps.schedule.sampled_after(step)]
    rounds = [{"rollouts": sampled["rollouts"], "rewards": scoring.rewards(steps, sampled, step, 0)}]
    while True:
        round_index = len(rounds)
        drawn = task(draw_round_task)(cfg, prompts_ids=steps.prompts, step=step, round_index=round_index,
                                      rounds=list(rounds))
        if drawn["replacements"] is None:
            break
        steps.wait_for_samplings()
        part = task(scoring.sampling_round)(cfg, prompts_ids=steps.prompts, policy_state=sampled_from, step=step,
                                            round_index=round_index, replacements=drawn["replacements"],
                                            resources=steps.res)
        rounds.append({"rollouts": part["rollouts"], "rewards": scoring.rewards(steps, part, step, round_index)})
    kept = task(kept_rows_task)(cfg, step=step, rounds=rounds)
    return ({"rollouts": kept["rollouts"], "rewards": kept["rewards"],
             "metrics": {**sampled["metrics"], **kept["sample_metrics"]}},
            {"rollouts": kept["scored"], "metrics": kept["score_metrics"]})
