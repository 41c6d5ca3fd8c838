"""TRL's GRPOTrainer on the job bench/bench_rl_vs_trl.py exported: runs in .venv-trl (scripts/setup-trl.sh), never in
the project venv, and imports nothing of rollout but its reward functions (rollout_lib/reward/functions.py: stdlib
at import, reasoning-gym when scored), so both tools score with the same code.

    .venv-trl/bin/python bench/trl_grpo_job.py --job DIR --out RESULT.json

DIR (written by the bench): model/ (the base model as a plain Hugging Face directory), job.json (the settings),
train.jsonl (one row per prompt, in the order rollout draws them: step 1's prompts_per_step rows, then step 2's, ...)
and eval.jsonl (the held-out prompts). Each row: messages (system + user), prompt_ids (rollout's rendering of them
with the chat template and the generation prompt), answer, info (JSON text).

GRPOConfig: per_device_train_batch_size = prompts x group and one accumulation step, so one optimizer step is one
generation batch, as one rollout step is; shuffle_dataset = False, so step s trains on rows of step s; beta = 0,
num_iterations = 1, loss_type = "dapo" (the step's token-summed loss over its total count of completion tokens:
rollout's normalisation), scale_rewards = "none" unless the env's grpo sets std_normalize, constant learning rate,
fp32 (bf16 = False: TRL's default is bf16), no gradient checkpointing (TRL's default is on), no checkpoints.

The result JSON: "steps", one record per optimizer step (and step 0): "end" (time.time() after the step and its
evaluation, if one was due), "eval_s", "accuracy" (held-out pass rate, at evaluated steps), "reward" and "loss"
(TRL's logged values); and "started" (time.time() when this script began).
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers 5.24 renamed gradient_checkpointing (which TRL's config still sets) and says so at every step.
warnings.filterwarnings("ignore", category=FutureWarning)

PASS = 1.0 - 1e-9  # rollout_lib/rl/evaluate.py: a reward of 1 (up to rounding) passes


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reward_callables(specs: list[dict], env: str) -> list:
    """rollout's built-in reward functions as TRL reward functions: one list of floats per batch, None where the
    function raised (rollout records such a reward as missing; TRL leaves it out of the weighted sum)."""
    sys.path.insert(0, str(ROOT))  # rollout_lib.reward.functions imports only the standard library
    from rollout_lib.reward.functions import BUILTIN_REWARD_FUNCTIONS, RewardInput, as_score

    made = []
    for spec in specs:
        function = BUILTIN_REWARD_FUNCTIONS[spec["function"]]
        kwargs = spec.get("kwargs") or {}

        def score(prompts, completions, answer, info, _function=function, _kwargs=kwargs, **_):
            scores = []
            for prompt, completion, expected, extra in zip(prompts, completions, answer, info):
                text = completion[-1]["content"] if isinstance(completion, list) else completion
                inp = RewardInput(prompt=prompt, completion_text=text, answer=expected,
                                  info=json.loads(extra) if extra else {}, env=env)
                try:
                    scores.append(as_score(_function(inp, **_kwargs)))
                except Exception:  # noqa: BLE001 - a missing reward, as in rollout's loop
                    scores.append(None)
            return scores

        score.__name__ = spec["function"]
        made.append(score)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    job = json.loads((args.job / "job.json").read_text())

    import torch

    torch.set_num_threads(job["torch_threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir = str(args.job / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train_rows, eval_rows = read_jsonl(args.job / "train.jsonl"), read_jsonl(args.job / "eval.jsonl")
    steps, per_step, group = job["steps"], job["prompts_per_step"], job["group_size"]
    if len(train_rows) != steps * per_step:
        raise SystemExit(f"train.jsonl: {len(train_rows)} rows, expected {steps} steps x {per_step}")

    # The prompts TRL renders (its own batched apply_chat_template call) must be the token ids rollout samples from.
    rendered = tokenizer.apply_chat_template([row["messages"] for row in train_rows], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    mismatched = [i for i, (ids, row) in enumerate(zip(rendered, train_rows)) if list(ids) != row["prompt_ids"]]
    if mismatched:
        raise SystemExit(f"TRL renders {len(mismatched)} train prompts differently from rollout (first: row "
                         f"{mismatched[0]})")

    dataset = Dataset.from_list([{"prompt": row["messages"], "answer": row["answer"], "info": row["info"]}
                                 for row in train_rows])
    config = GRPOConfig(
        output_dir=str(args.job / "trl-output"),
        max_steps=steps,
        per_device_train_batch_size=per_step * group,
        gradient_accumulation_steps=1,
        num_generations=group,
        shuffle_dataset=False,
        max_completion_length=job["max_tokens"],
        temperature=job["temperature"],
        top_p=job["top_p"],
        top_k=0,
        learning_rate=job["lr"],
        adam_beta1=job["betas"][0],
        adam_beta2=job["betas"][1],
        adam_epsilon=job["eps"],
        weight_decay=job["weight_decay"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=job["max_grad_norm"] if job["max_grad_norm"] is not None else 0.0,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group" if job["std_normalize"] else "none",
        reward_weights=[spec["weight"] for spec in job["rewards"]],
        seed=job["seed"],
        data_seed=job["seed"],
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        use_vllm=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    stop_ids, pad_id = job["stop_ids"], job["pad_id"]
    eval_specs = job["eval_rewards"]
    eval_functions = reward_callables(eval_specs, job["env"])
    records: list[dict] = []

    def evaluate(model) -> float:
        """Held-out pass rate: every eval prompt once, greedy, max_tokens new tokens, one batched generate call."""
        width = max(len(row["prompt_ids"]) for row in eval_rows)
        input_ids = torch.full((len(eval_rows), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(eval_rows), width), dtype=torch.long)
        for index, row in enumerate(eval_rows):
            input_ids[index, width - len(row["prompt_ids"]):] = torch.tensor(row["prompt_ids"])
            attention[index, width - len(row["prompt_ids"]):] = 1
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                output = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=GenerationConfig(
                    do_sample=False, max_new_tokens=job["eval_max_tokens"], eos_token_id=stop_ids, pad_token_id=pad_id))
        finally:
            model.train(was_training)
        texts = []
        for tokens in output[:, width:].tolist():
            end = next((i + 1 for i, token in enumerate(tokens) if token in stop_ids), len(tokens))
            texts.append(tokenizer.decode(tokens[:end], skip_special_tokens=True))
        columns = [fn([row["messages"] for row in eval_rows], texts, [row["answer"] for row in eval_rows],
                      [row["info"] for row in eval_rows]) for fn in eval_functions]
        rewards = [None if any(value is None for value in values)
                   else math.fsum(spec["weight"] * value for spec, value in zip(eval_specs, values))
                   for values in zip(*columns)]
        return sum(reward is not None and reward >= PASS for reward in rewards) / len(rewards)

    class Timeline(TrainerCallback):
        """Each step's end (after its evaluation, as rollout's metrics file stamps a step), the held-out pass rate at
        step 0, every `eval_every` steps and the last, and what TRL logs per step."""

        trainer = None

        def _record(self, step: int) -> None:
            due = step % job["eval_every"] == 0 or step in (0, steps)
            record = {"step": step, "eval_s": 0.0}
            if due:
                began = time.perf_counter()
                record["accuracy"] = evaluate(self.trainer.accelerator.unwrap_model(self.trainer.model))
                record["eval_s"] = time.perf_counter() - began
            record["end"] = time.time()
            records.append(record)
            held_out = f"held-out {record['accuracy']:.3f}, " if due else ""
            print(f"trl step {step}: {held_out}{record['end'] - STARTED:.1f} s since start", file=sys.stderr,
                  flush=True)

        def on_train_begin(self, args, state, control, **kwargs):
            self._record(0)

        def on_step_end(self, args, state, control, **kwargs):
            self._record(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and records and records[-1]["step"] == state.global_step:
                records[-1].update({key: logs[key] for key in ("reward", "loss", "grad_norm") if key in logs})

    timeline = Timeline()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_callables(job["rewards"], job["env"]), args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[timeline])
    timeline.trainer = trainer
    trainer.train()
    finished = time.time()
    args.out.write_text(json.dumps({"started": STARTED, "finished": finished, "steps": records,
                                    "trl_version": __import__("trl").__version__,
                                    "loss_type": config.loss_type, "scale_rewards": config.scale_rewards,
                                    "optim": str(config.optim)}, indent=2))


if __name__ == "__main__":
    main()
