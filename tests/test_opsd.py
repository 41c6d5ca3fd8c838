"""opsd (on-policy self-distillation): the policy learns to answer, without a hint, the way it answers when shown a
demonstration. The base is the tiny model taught by train-sft to copy a demonstration given in the prompt (and to
say "ok" without one); opsd then moves its unhinted answers to the hinted ones: the KL to the
demonstration-conditioned reference falls and the task reward (12 words) rises."""

from __future__ import annotations

import json

import pytest

from clirun import ROOT, final_result, metrics_table, run_rollout

pytestmark = pytest.mark.slow

DEMO = "the sea is calm and the sky is blue and the sun"  # 12 words: target_length(12) scores it 1.0
HINT = "Here is an example of a good answer:\n{demo}"  # OpsdSettings.hint_template's default


@pytest.fixture(scope="module")
def hint_following_base(prefect_server, tmp_path_factory):
    """(exported base model directory, prompts JSONL with info.demo, workdir)."""
    workdir = tmp_path_factory.mktemp("opsd")
    sft_rows, rl_rows = [], []
    for line in (ROOT / "data/rl-tiny-prompts.jsonl").read_text().splitlines():
        prompt = json.loads(line)
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        hinted = [*messages[:-1], {"role": "user", "content": f"{messages[-1]['content']}\n\n{HINT.format(demo=DEMO)}"}]
        sft_rows.append({"messages": [*hinted, {"role": "assistant", "content": DEMO}]})
        sft_rows.append({"messages": [*messages, {"role": "assistant", "content": "ok"}]})
        rl_rows.append({"messages": messages, "info": {"demo": DEMO}})
    (workdir / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in sft_rows))
    (workdir / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rl_rows))
    store = workdir / "store"
    trained = run_rollout("train", "sft", "--config", "configs/sft-tiny.toml", "--set", "run.name=hinted",
                          "--set", f"run.store={store}", "--set", f"algorithm.sft.dataset.path={workdir / 'sft.jsonl'}",
                          "--set", "algorithm.sft.budget.max_steps=40", "--set", "algorithm.sft.checkpoint_interval=40",
                          "--set", "algorithm.sft.optimizer.kind=adamw", "--set", "algorithm.sft.optimizer.lr=1e-2",
                          "--set", "algorithm.sft.minibatch_size=8")
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = run_rollout("export", "--checkpoint", "runs/hinted/latest", "--store", str(store),
                           "--out", str(workdir / "base"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    return workdir


def opsd_args(workdir, run_name: str, prompts: str, steps: int = 12) -> list[str]:
    return ["train", "rl", "--config", "configs/rl-tiny.toml", "--set", f"run.name={run_name}",
            "--set", f"run.store={workdir / 'store'}", "--set", f"algorithm.rl.base_model={workdir / 'base'}",
            "--set", f'algorithm.rl.envs[0].source={{ type = "jsonl_path", path = "{prompts}" }}',
            "--set", f"algorithm.rl.budget.max_steps={steps}", "--set", f"algorithm.rl.checkpoint_interval={steps}",
            "--set", "algorithm.rl.envs[0].sampling.max_tokens=24", "--set", 'algorithm.rl.envs[0].algo={ type = "opsd" }',
            # rl-tiny's 1e-2 is a grpo rate: distilling at it swung from seed to seed (seed 2: reward 0.10 -> 0.21,
            # seed 4 learned then fell back), at 3e-3 every seed learns smoothly (test below)
            "--set", "algorithm.rl.optimizer.lr=3e-3"]


@pytest.mark.learning
def test_opsd_learns_to_answer_as_if_shown_the_demonstration(hint_following_base):
    """12 steps of opsd from the hint-following base. Measured with seeds 1-4 (an AVX-512 machine): task reward over
    the first 3 steps 0.15-0.28 -> last 3 steps 0.63-0.81 (gains 0.48-0.63; asserted > 0.3); reverse KL to the
    demonstration-conditioned reference 3.1-4.3 -> 0.78-1.27 (last/first 0.18-0.32; asserted < 0.75)."""
    workdir = hint_following_base
    learned = run_rollout(*opsd_args(workdir, "opsd", str(workdir / "prompts.jsonl")))
    assert learned.returncode == 0, learned.stderr[-3000:]
    rewards = final_result(learned)["reward_curve"]
    kl = metrics_table("opsd")["ref_kl/kl"]
    print("opsd task reward per step:", [round(v, 3) for v in rewards])
    print("opsd KL to the demonstration-conditioned reference per step:", [round(v, 3) for v in kl])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards
    assert sum(kl[-3:]) / 3 < 0.75 * sum(kl[:3]) / 3, kl


def test_a_prompt_without_its_demonstration_fails_the_step_in_one_line(hint_following_base, tmp_path):
    workdir = hint_following_base
    prompts = tmp_path / "no-demo.jsonl"
    rows = [{"prompt": f"Say something {i}.", "info": {"demo": "hi"}} for i in range(3)] + [{"prompt": "Name animals."}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))  # 4 = prompts_per_step: all are drawn
    failed = run_rollout(*opsd_args(workdir, "opsd-no-demo", str(prompts), steps=1))
    assert failed.returncode == 1
    errors = [line for line in failed.stderr.splitlines() if line.startswith("rollout: error:")]
    assert len(errors) == 1, failed.stderr[-2000:]
    assert "algorithm.rl.envs[0].algo: prompt" in errors[0] and "(line 4) has no info['demo']" in errors[0]
