"""rlhf: supervised fine-tuning, a reward model, then RL against it, as one DAG of three subflows.

train-sft -> train-rm (from the SFT checkpoint, or its own base model) -> train-rl (the policy starts from the SFT
checkpoint; the rewarded envs score with the RM checkpoint)

Each stage is the entry point's own flow, run as a subflow on its own config plus the pipeline's overrides, so its
tasks are cached by content as they are when it runs alone: a rerun after changing only an RL setting returns
every SFT and RM task from cache and trains RL only; a killed pipeline, rerun, ends on the same final checkpoint.
Stages chain by checkpoint id, never by a moving ref: what RL trained from is fixed in its training identity.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow, flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.common import artifact_key, flow_run_name, publish_result, tag_flow_run
from flows.train_rl import train_rl
from flows.train_rm import train_rm
from flows.train_sft import train_sft
from rollout_lib.config import RlhfConfig
from rollout_lib.identity.training import training_identity
from rollout_lib.plan_checks import checked, load_config

STAGE_FLOWS: dict[str, Flow] = {"sft": train_sft, "rm": train_rm, "rl": train_rl}


@flow(name="rlhf", flow_run_name=flow_run_name, log_prints=True)
def rlhf(config: str = "configs/rlhf-tiny.toml", overrides: list[str] | dict[str, Any] | None = None) -> dict:
    """SFT -> RM -> RL. `config`: the pipeline's TOML (its three stage configs and their overrides); `overrides`:
    ["key.path=value", ...] or {"key.path": value} on it, e.g. ['rl.overrides=["algorithm.rl.optimizer.lr=5e-3"]']."""
    logger = get_run_logger()
    cfg = load_config(RlhfConfig, config, overrides)  # every stage's settings validated before SFT trains
    tag_flow_run(cfg.run.name)

    sft, _ = run_stage(cfg, "sft")
    rm, _ = run_stage(cfg, "rm", sft_checkpoint=sft["checkpoint"])
    rl, rl_result = run_stage(cfg, "rl", sft_checkpoint=sft["checkpoint"], rm_checkpoint=rm["checkpoint"])

    stages = {"sft": sft, "rm": rm, "rl": rl}
    create_markdown_artifact(_summary(cfg, stages, rl_result["reward_curve"]),
                             key=artifact_key(cfg.run.name, "summary"), description="rlhf summary")
    logger.info("final checkpoint %s (run %s)", rl["checkpoint"], rl["run"])
    return publish_result(cfg.run.name, {
        "checkpoint": rl["checkpoint"], "stages": stages, "reward_curve": rl_result["reward_curve"],
        "eval_curves": rl_result["eval_curves"], "last_metrics": rl_result["last_metrics"]})


def run_stage(cfg: RlhfConfig, stage: str, **checkpoints: str) -> tuple[dict, dict]:
    """One stage as a subflow named after its run (`<run.name>-<stage>-<identity>`). Returns what the pipeline
    records of it (run name, flow run id, final checkpoint, what it started from and, for RL, its reward models)
    and the stage flow's own result."""
    logger = get_run_logger()
    overrides = cfg.stage_overrides(stage, **checkpoints)
    stage_config = checked(cfg.stage_config(stage, **checkpoints), cfg.stage(stage).config)
    name = cfg.stage_run_name(stage, training_identity(stage_config))
    overrides["run.name"] = name
    logger.info("%s: run %s on %s, from %s", stage, name, cfg.stage(stage).config,
                stage_config.settings.base_model.uri)
    state = STAGE_FLOWS[stage].with_options(flow_run_name=name)(
        config=cfg.stage(stage).config, overrides=overrides, return_state=True)
    result = state.result()  # a failed stage raises its error here: the pipeline fails with it
    logger.info("%s: final checkpoint %s", stage, result["checkpoint"])
    record = {"run": name, "flow_run_id": str(state.state_details.flow_run_id), "checkpoint": result["checkpoint"],
              "base_model": stage_config.settings.base_model.uri}
    if result.get("eval_after"):  # the RM's held-out pair accuracy, when its config has held-out pairs
        record["eval_after"] = result["eval_after"]
    if stage == "rl":
        record["reward_models"] = {where: reward.reward_model.uri for where, reward in stage_config.reward_models()}
    return record, result


def _summary(cfg: RlhfConfig, stages: dict[str, dict], curve: list[float]) -> str:
    rl = stages["rl"]
    lines = [
        f"# rlhf `{cfg.run.name}`",
        "",
        f"- final checkpoint: `{rl['checkpoint']}`",
        f"- store: `{cfg.run.store}`",
        "",
        "| stage | run | config | starts from | final checkpoint |",
        "|---|---|---|---|---|",
        *(f"| {stage} | `{result['run']}` | `{cfg.stage(stage).config}` | `{result['base_model']}` | "
          f"`{result['checkpoint']}` |" for stage, result in stages.items()),
        "",
        f"- RL rewarded by the RM checkpoint in: {', '.join(sorted(rl['reward_models'])) or 'no env'}",
        f"- RL mean reward: step 1 {curve[0]:.3f} -> step {len(curve)} {curve[-1]:.3f}",
    ]
    return "\n".join(lines)
