"""A step's DAPO dynamic sampling rounds as task runs (tasks/rl_rounds.py; rollout_lib/rl/dynamic_sampling.py
decides which groups are uniform, what each round draws and what the step keeps).

After the step's sample stage and its rewards (round 0), draw-step-k-round-1 draws the replacement prompts from
round 0's rows and rewards; round 1 is sampled and scored the run's way (the Scoring's `sampling_round` and
`rewards`: streamed, staged or chunked); draw-step-k-round-2 draws after rounds 0 and 1, and so on until a draw
finds nothing to draw; then dynamic-sampling-step-k keeps the groups with signal. Every task's key holds the ids of
the rounds before it, so a rerun returns the rounds a killed run finished from cache and goes on from the first it
did not.

Off-policy, the step's rounds sample from the state its first draw sampled from, before the next step's sample
stage is submitted (flows/rl_steps.py); with k >= 2 later steps' stages may be in flight still, and a round waits
for them first (a policy server holds one state at a time), as an evaluation does.
"""

from __future__ import annotations

from tasks.rl_rounds import draw_round_task, kept_rows_task


def resampled_step(steps, sampled: dict, step: int) -> dict:
    """Step `step`'s rounds after its sample stage's result `sampled` (`steps`: the run's flows.rl_steps.RlSteps,
    whose Scoring runs each round's sample and score stages): the kept rows as the step's sample result (table,
    rewards, metrics: the first draw's, with the kept rows' and `dynamic_sampling/*` over them), with `scored`, the
    kept rows' score result (table and metrics)."""
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
    return {"rollouts": kept["rollouts"], "rewards": kept["rewards"],
            "metrics": {**sampled["metrics"], **kept["sample_metrics"]},
            "scored": {"rollouts": kept["scored"], "metrics": kept["score_metrics"]}}
