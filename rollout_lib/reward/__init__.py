"""The reward loop: per-rollout async scoring with user reward functions.

- `contract`: RewardInput, as_score, is_async_callable: what a reward function is given and how it is called
- `functions`: the built-ins, resolve_reward_function, check_reward_function (plan time)
- `locate`: finds a user's reward function without running its module (for `--dry-run`)
- `loop`: RewardLoop, score_inputs(_sync) (and the results helpers below, re-exported)
- `pool`: the killable worker processes for sync functions
- `results`: RewardResult, reward_metrics, raise_if_all_missing, raise_if_too_many_missing (the circuit breaker)
- `tables`: reward_input(s) / apply_rewards between the loop and the ROLLOUTS wire (a row as a dict or a table)
- `verl`: the adapter that runs verl-style compute_score functions unchanged
- `servers`, `judge_tokenizer`: what a function that asks a judge is handed (its router's address, its tokenizer)

Deliberately no re-exports here: every sync worker process imports this package, and should pay only for
`pool` and the user's functions, not for pyarrow.
"""
