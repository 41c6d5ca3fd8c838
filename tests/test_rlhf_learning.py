"""RLHF learns what the preferences encode: `rollout train rlhf --config configs/rlhf-length.toml` trains a reward
model on pairs that prefer responses closer to 12 words (data/make_rlhf_pairs.py), then grpo against it; the rule
itself is watched as a weight-0 reward on the training rollouts and on held-out prompts (the env's `eval`).

Measured (2 CPU cores, ~35 s; docs/rlhf.md has the whole curves): RM held-out pair accuracy 0.91 (from the SFT checkpoint); the RM's
score on the training rollouts 0.54 -> 7.57; the true reward 0.42 -> 0.90 (step 21) -> 0.79 (step 30), on held-out
prompts 0.47 (step 5) -> 0.89 (step 20) -> 0.79 (step 30): past ~20 steps the policy overshoots 12 words, which the
RM, trained only on pairs where the longer response won, keeps rewarding."""

from __future__ import annotations

import pytest

from clirun import ROOT, final_result, metrics_table, run_rollout
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.config.loading import apply_overrides, read_toml
from rollout_lib.plan_checks import validate_config
from rollout_lib.identity.training import training_identity

EVAL = ('{ source = { type = "jsonl_path", path = "data/rlhf-heldout-prompts.jsonl" }, every = 5 }')


def rl_config(tmp_path, *overrides: str) -> RlConfig:
    return validate_config(RlConfig, apply_overrides(read_toml(ROOT / "configs/rl-tiny.toml"),
                                                     [f"run.store={tmp_path}", *overrides]))


def test_evaluation_settings_never_change_the_training(tmp_path):
    plain = rl_config(tmp_path)
    watched = rl_config(tmp_path, f"algorithm.rl.envs[0].eval={EVAL}")
    assert training_identity(watched) == training_identity(plain)
    env = watched.settings.envs[0]
    assert env.eval_sampling().temperature == 0 and env.eval_sampling().group_size == 1  # greedy, one per prompt
    with pytest.raises(ConfigError, match=r"envs\[0\]: .*temperature = 0 \(greedy\) is for evaluation"):
        rl_config(tmp_path, "algorithm.rl.envs[0].sampling.temperature=0")
    with pytest.raises(ConfigError, match=r"envs\[0\]\.eval\.every: "):
        rl_config(tmp_path, 'algorithm.rl.envs[0].eval={ source = { type = "jsonl_path", path = "x" }, every = 0 }')


def mean(values: list) -> float:
    return sum(values) / len(values)


@pytest.mark.learning
@pytest.mark.slow
def test_rl_against_the_learned_reward_model_raises_the_true_reward(prefect_server, tmp_path):
    done = run_rollout("train", "rlhf", "--config", "configs/rlhf-length.toml", "--set", f"run.store={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    stages = final_result(done)["stages"]
    rm, rl = metrics_table(stages["rm"]["run"]), metrics_table(stages["rl"]["run"])
    rm_name = f"reward_model({stages['rm']['checkpoint']})"

    assert rm["accuracy"][-1] > 0.8  # the RM learned the rule from the pairs (train accuracy, last step)
    steps = rl["step"]
    assert steps == list(range(1, 31))
    rm_score, true = rl["reward_mean"], rl["reward/target_length"]
    assert rl[f"reward/{rm_name}"] == pytest.approx(rm_score)  # the true reward has weight 0: RM score alone
    print(f"RM score {[round(v, 2) for v in rm_score]}\ntrue reward {[round(v, 3) for v in true]}")
    assert mean(rm_score[-5:]) > mean(rm_score[:5]) + 3.0
    assert max(mean(true[i:i + 5]) for i in range(len(true) - 4)) > mean(true[:5]) + 0.3

    evaluated = [i for i, value in enumerate(rl["eval/words/target_length"]) if value != ""]
    assert [steps[i] for i in evaluated] == [5, 10, 15, 20, 25, 30]  # every 5 steps (step 0: the flow's result)
    held_out_true = [rl["eval/words/target_length"][i] for i in evaluated]
    held_out_rm = [rl[f"eval/words/{rm_name}"][i] for i in evaluated]
    print(f"held-out: true {held_out_true}, RM {held_out_rm}")
    assert max(held_out_true) > held_out_true[0] + 0.2 and held_out_rm[-1] > held_out_rm[0] + 1.0
