"""On-policy RL, one step at a time, each stage a plain function from tables to tables:

    prompts (`prompts`) -> sample (`sample`) -> score (`score`) -> advantages (`advantages`) -> pack (`pack`)
    -> train step of the policy (`policy`)

Determinism on CPU: prompts are drawn per (seed, step, env), sampling is seeded by (seed, step, env), training
seeds dropout from (seed, step) and the learning rate is a function of the step, so an interrupted-and-rerun
run reaches the same final checkpoint id as an uninterrupted one.
"""
