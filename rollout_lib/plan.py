"""`--dry-run`: validate everything that can be validated without loading a model, and describe the plan. Every model
reference must load offline (or downloads be on), and a served teacher must share the policy's tokenizer: checked
from the references' files alone (tokenizers, never weights)."""

from __future__ import annotations

import math

from rollout_lib.config.rl import RlConfig, env_locator
from rollout_lib.config.rlhf import STAGES, RlhfConfig
from rollout_lib.config.rm import RmConfig
from rollout_lib.config.sft import SftConfig
from rollout_lib.data import read_examples, read_pairs
from rollout_lib.data.tool_messages import has_tool_calls
from rollout_lib.model.chat import tool_template_problem, use_chat_template
from rollout_lib.model.loading import load_tokenizer, locate_model, offline_problem
from rollout_lib.errors import ConfigError
from rollout_lib.plan_checks import checked, plan_warnings
from rollout_lib.hardware import hardware_settings, resolve_hardware
from rollout_lib.reward.judge_tokenizer import plan_problem as judge_tokenizer_problem
from rollout_lib.serving.settings import ServedModel
from rollout_lib.serving.tokenizers import local_tokenizer_mismatch
from rollout_lib.settings_base import ModelRef
from rollout_lib.store import StoreError
from rollout_lib.trainer.segment import SnapshotSchedule


def describe_plan(config) -> dict:
    if isinstance(config, RlhfConfig):
        return _rlhf_plan(config)
    if isinstance(config, RmConfig):
        plan = _rm_plan(config)
    elif isinstance(config, SftConfig):
        plan = _sft_plan(config)
    elif isinstance(config, RlConfig):
        plan = _rl_plan(config)
    else:
        raise TypeError(f"no plan for {type(config).__name__}")
    _check_models_offline(config)
    if isinstance(config, RlConfig):
        _check_shared_tokenizers(config)
        _check_tool_template(config)
    return {**plan, "hardware": _hardware(config)}


def _model_references(config) -> list[tuple[str, ModelRef]]:
    """(locator, reference) of every model a run loads or serves itself: the base model, the frozen models rollout
    serves (a teacher, a sampling source, a judge) and the reward models."""
    found = [(f"algorithm.{config.algorithm.kind}.base_model", config.settings.base_model)]
    if isinstance(config, RlConfig):
        found += [(f"{where}.model", _in_run_store(config, frozen.model)) for where, frozen in config.frozen_models()
                  if isinstance(frozen, ServedModel)]
        found += [(where, reward.reward_model) for where, reward in config.reward_models()]
    return found


def _judged_rewards(config: RlConfig) -> list[tuple[str, object]]:
    """(locator of its judge, reward) of every reward that names a judge."""
    return [(env_locator(index, f"rewards[{r_index}].judge"), reward) for index, env in enumerate(config.settings.envs)
            for r_index, reward in enumerate(env.rewards) if getattr(reward, "judge", None) is not None]


def _check_models_offline(config) -> None:
    """A hub id the run could not load offline fails here, naming its setting, not when the run loads it."""
    problems = [(where, problem) for where, ref in _model_references(config)
                if (problem := offline_problem(ref)) is not None]
    if isinstance(config, RlConfig):  # the judge's tokenizer a reward function takes
        problems += [problem for where, reward in _judged_rewards(config)
                     if (problem := judge_tokenizer_problem(reward, where)) is not None]
    if problems:
        raise ConfigError(problems)


def _check_shared_tokenizers(config: RlConfig) -> None:
    """A teacher or sampling source rollout serves must share the policy's tokenizer: checked here on the two
    tokenizers, loaded offline from their references (no weights), with the probes the run sends the server once
    vLLM has started (serving/tokenizers.py). Judges read text: any tokenizer will do."""
    judges = {where for where, _ in config.judges()}
    shared = [(where, frozen) for where, frozen in config.frozen_models()
              if isinstance(frozen, ServedModel) and where not in judges]
    if not shared:
        return
    base_model = config.settings.base_model
    policy = use_chat_template(load_tokenizer(locate_model(base_model)), config.settings.chat_template)  # as run
    problems = []
    for where, frozen in shared:
        mismatch = local_tokenizer_mismatch(load_tokenizer(locate_model(_in_run_store(config, frozen.model))), policy)
        if mismatch:
            problems.append((where, f"{frozen.model.uri!r} does not share the policy's tokenizer (base_model "
                                    f"{base_model.uri!r}): {mismatch}"))
    if problems:
        raise ConfigError(problems)


TOOLS_TEMPLATE_EXAMPLE = "configs/templates/chatml-tools.jinja"


def _check_tool_template(config: RlConfig) -> None:
    """An env with tools needs a chat template that renders them, its calls and their results, token-exactly
    (model/chat.py tool_template_problem): the policy's own or `algorithm.rl.chat_template`. Checked on the
    tokenizer alone, before anything runs."""
    with_tools = [index for index, env in enumerate(config.settings.envs) if env.tools or _verifiers_tools(env) or (
        env.interaction is not None and getattr(env.interaction, "action", None) == "tool_call")]  # OpenEnv's
    if not with_tools:
        return
    refusal = tool_template_refusal(config, "the policy's")
    if refusal is not None:
        raise ConfigError([(env_locator(index, _tools_place(config.settings.envs[index])), refusal)
                           for index in with_tools])


def tool_template_refusal(config, whose: str) -> str | None:
    """Why the run's chat template (the base model's own, or the entry point's `chat_template` override) cannot
    frame tool calls, naming the setting that supplies one; None when it can."""
    override, setting = config.settings.chat_template, f"algorithm.{config.algorithm.kind}.chat_template"
    problem = tool_template_problem(use_chat_template(load_tokenizer(locate_model(config.settings.base_model)),
                                                      override))
    if problem is None:
        return None
    if override is None:
        return (f"{whose} chat template does not render tools or tool calls ({problem}); give one that does in "
                f"{setting} (e.g. {TOOLS_TEMPLATE_EXAMPLE})")
    return (f"{setting} ({override}) does not render tools or tool calls token-exactly ({problem}); e.g. "
            f"{TOOLS_TEMPLATE_EXAMPLE} does")


def _tools_place(env) -> str:
    """Where an env's tools come from, for the refusal's locator."""
    if env.tools:
        return "tools"
    return "interaction" if _verifiers_tools(env) else "interaction.action"


def _verifiers_tools(env) -> bool:
    """Whether the env runs a verifiers environment that has tools (a ToolEnv): loaded already, its prompts read."""
    if env.interaction is None or env.interaction.type != "verifiers":
        return False
    from rollout_lib.envs.verifiers_env import load_verifiers_environment

    return bool(getattr(load_verifiers_environment(env.interaction), "tool_defs", None))


def _in_run_store(config, ref: ModelRef) -> ModelRef:
    """A served model's reference as the run resolves it: a checkpoint ref is looked up in the run's store."""
    return ref if ref.store else ref.model_copy(update={"store": config.run.store})


def _hardware(config) -> dict:
    """The entry point's hardware settings and the device they resolve to on this machine: a CUDA device it lacks,
    or bf16 that would run on its CPU, fails here naming the setting (docs/hardware.md)."""

    settings = hardware_settings(config.settings)
    return {**settings.model_dump(mode="json"),
            "resolved_device": str(resolve_hardware(settings, config.hardware_locator).device)}


def _rm_plan(config: RmConfig) -> dict:
    settings = config.settings
    train_rows = read_pairs(settings.dataset, "algorithm.rm.dataset").num_rows  # every row: a bad one fails here
    eval_rows = read_pairs(settings.eval_dataset, "algorithm.rm.eval_dataset").num_rows if settings.eval_dataset else 0
    steps = settings.budget.max_steps
    return {
        **_plan_head(config, "train-rm"),
        "train_pairs": train_rows,
        "eval_pairs": eval_rows,
        "steps": steps,
        "pairs_per_step": settings.minibatch_size,
        "batches_per_epoch": math.ceil(train_rows / settings.minibatch_size),
        "epochs": round(steps * settings.minibatch_size / train_rows, 3),
        **_plan_tail(settings),
    }


def _sft_plan(config: SftConfig) -> dict:
    settings = config.settings
    train = read_examples(settings.dataset, "algorithm.sft.dataset")  # every row: a bad one fails here
    held_out = read_examples(settings.eval_dataset, "algorithm.sft.eval_dataset") if settings.eval_dataset else None
    eval_rows = held_out.num_rows if held_out is not None else 0
    _check_sft_tool_template(config, {"algorithm.sft.dataset": train, "algorithm.sft.eval_dataset": held_out})
    steps = settings.budget.max_steps
    turns = sum(1 for messages in train["messages"].to_pylist() for m in messages if m["role"] == "assistant")
    return {
        **_plan_head(config, "train-sft"),
        "train_examples": train.num_rows,
        "assistant_turns": turns,
        "eval_examples": eval_rows,
        "loss_on": settings.loss_on.kind,
        "steps": steps,
        "examples_per_step": settings.minibatch_size,
        "micro_batches_per_step": (f"packed: <= {settings.packing.max_seq_len} tokens each" if settings.packed
                                   else settings.gradient_accumulation),
        "max_seq_len": settings.packing.max_seq_len,
        "epochs": round(steps * settings.minibatch_size / train.num_rows, 3),
        **_plan_tail(settings),
    }


def _check_sft_tool_template(config: SftConfig, tables: dict) -> None:
    """Examples with tools or tool calls need a chat template that renders them (as an RL env with tools does):
    else the model would be trained on conversations with the calls left out."""
    with_tools = [where for where, table in tables.items() if table is not None and (
        table["tools"].null_count < table.num_rows
        or any(has_tool_calls(messages) for messages in table["messages"].to_pylist()))]
    if with_tools and (refusal := tool_template_refusal(config, "the base model's")) is not None:
        raise ConfigError([(with_tools[0], f"the examples have tools or tool calls, and {refusal}")])


def _rl_plan(config: RlConfig) -> dict:
    from rollout_lib.rl.prompts import check_distinct_examples, load_prompts

    settings = config.settings
    # parses or generates every prompt (a table's are built column-wise, data/prompts.py)
    prompts = {env.name: load_prompts(env, env_locator(index, "source")) for index, env in enumerate(settings.envs)}
    check_distinct_examples(prompts)
    frozen = _frozen_model_contents(config)
    steps = settings.budget.max_steps
    return {
        **_plan_head(config, "train-rl"),
        "envs": [
            {"name": env.name, "source": env.source.type, "prompts": prompts[env.name].num_rows,
             "algo": env.algo.model_dump(mode="json"), "rewards": [_reward_name(r) for r in env.rewards],
             "sampler": env.sampler.model_dump(mode="json")["source"],
             "sampling": env.sampling.model_dump(mode="json"),
             "rollouts_per_step": env.prompts_per_step * env.sampling.group_size}
            for env in settings.envs
        ],
        "rollouts_per_step": sum(env.prompts_per_step * env.sampling.group_size for env in settings.envs),
        "frozen_models": frozen,
        "reward_models": _reward_model_contents(config),
        "steps": steps,
        "policy_sampler": settings.policy_sampler.model_dump(mode="json"),
        **({} if settings.partial_rollouts is None else {"partial_rollouts": {
            "token_budget": settings.partial_rollouts.token_budget, "max_staleness": settings.staleness_bound,
            "behaviour_logprobs": settings.behaviour_logprobs_source,
            "note": "requests cut every token_budget tokens per policy version and carried token-in to the next; "
                    "a step trains the groups whose last sample ended; the last step drains"}}),
        "micro_batches": (f"packed: <= {config.packed_tokens} tokens each" if settings.packing
                          else f"{settings.sequences_per_micro_batch} sequences each"),
        **_plan_tail(settings),
        "warnings": [f"{locator}: {message}" for locator, message in plan_warnings(config)],
    }


def _rlhf_plan(config: RlhfConfig) -> dict:
    """Each stage's plan, made before any stage has trained: what a stage takes from an earlier one (the SFT
    checkpoint as its base model, the RM checkpoint as a reward) is named as such, and so is the run name of a
    stage whose training identity depends on it."""
    from rollout_lib.identity.training import training_identity

    sft_checkpoint, rm_checkpoint = "<the sft stage's checkpoint>", "<the rm stage's checkpoint>"
    plans = {}
    for stage in STAGES:
        # No checkpoint given: the stage config's own model and rewards.
        stage_config = checked(config.stage_config(stage), config.stage(stage).config)
        plan = describe_plan(stage_config)
        if stage == "sft" or (stage == "rm" and config.rm.start_from == "base_model"):
            plan["run"] = config.stage_run_name(stage, training_identity(stage_config))
        else:
            plan["run"] = f"{config.run.name}-{stage}-<its training identity, known once earlier stages have trained>"
            plan["model"] = {"reference": sft_checkpoint}
        if stage == "rl":
            replaced = {index for index, target in config.rewarded_envs() if not target.keep_rewards}
            reward_models = {where: content for where, content in plan["reward_models"].items()
                             if not any(where.startswith(env_locator(index) + ".") for index in replaced)}
            for index, target in config.rewarded_envs():
                env = plan["envs"][index]
                env["rewards"] = [*(env["rewards"] if target.keep_rewards else []),
                                  f"reward_model {rm_checkpoint} (weight {target.weight:g})"]
                reward_models[env_locator(index, f"rewards[{len(env['rewards']) - 1}].reward_model")] = \
                    rm_checkpoint
            plan["reward_models"] = reward_models
        plans[stage] = plan
    return {"entry_point": "rlhf", "run": config.run.name, "store": config.run.store, "stages": plans}


def _frozen_model_contents(config: RlConfig) -> dict[str, str]:
    """Each frozen model's identity: a served name, or what a reference rollout serves resolves to (a checkpoint
    id or content digest). A reference that resolves nowhere (a teacher's `runs/<name>/latest` not trained yet)
    fails here, naming its setting, as it would at the start of the run. No server is contacted."""
    from rollout_lib.identity.training import served_model_contents

    served = served_model_contents(config)  # raises the one-line error for a reference that resolves nowhere
    return {where: served.get(where) or f"served name {settings.name!r} at {', '.join(settings.base_url)}"
            for where, settings in config.frozen_models()}


def _reward_name(reward) -> str:
    if hasattr(reward, "function"):
        return reward.function
    if hasattr(reward, "rubric"):
        return f"the verifiers environment's rubric (weight {reward.weight:g})"
    if hasattr(reward, "reward_model"):
        if reward.base_url is not None:
            return f"reward_model {reward.reward_model.uri} (your vLLM pooling server at {', '.join(reward.base_url)})"
        return f"reward_model {reward.reward_model.uri}" + (" (served by vLLM)" if reward.engine == "vllm" else "")
    return "llm judge"


def _reward_model_contents(config: RlConfig) -> dict[str, str]:
    """Each reward model's identity (a checkpoint id or content digest), checked as far as it can be without loading
    it: a reference that resolves nowhere, a checkpoint that is not a reward model's, a local model that is no
    sequence classifier fail here, naming their setting."""
    from rollout_lib.model.loading import ModelLoadError
    from rollout_lib.reward.reward_model import check_reward_model
    from rollout_lib.identity.training import reward_model_contents

    found = config.reward_models()
    problems = []
    for where, reward in found:
        try:
            check_reward_model(reward.reward_model)
        except (ModelLoadError, StoreError) as exc:
            problems.append((where, str(exc)))
    if problems:
        raise ConfigError(problems)
    return dict(zip([where for where, _ in found], reward_model_contents(config)))


def _plan_head(config, entry_point: str) -> dict:
    resolved = locate_model(config.settings.base_model)  # where it is; nothing loaded or converted
    return {"entry_point": entry_point, "run": config.run.name, "store": config.run.store,
            "model": {"reference": config.settings.base_model.uri, "resolved": resolved.source,
                      "gguf_file": resolved.gguf_file}}


def _plan_tail(settings) -> dict:
    return {"snapshots_at": SnapshotSchedule(settings.checkpoint_interval, settings.budget.max_steps).steps(),
            "optimizer": settings.optimizer.model_dump(mode="json"), "extending": _extending(settings)}


def _extending(settings) -> str:
    """What raising max_steps later does to this run: the learning rate of a decaying schedule depends on its
    horizon, so whether finished steps are reused is decided here, explicitly."""
    optimizer = settings.optimizer
    if optimizer.schedule == "constant":
        return "raising max_steps later continues this run from its last step"
    if optimizer.decay_steps:
        return (f"the {optimizer.schedule} schedule decays over decay_steps = {optimizer.decay_steps}: raising "
                "max_steps later continues this run from its last step")
    return (f"the {optimizer.schedule} schedule decays over max_steps: raising it later changes every step's "
            "learning rate, so it is another training (a new run.name, from step 0); set optimizer.decay_steps "
            "to be able to extend")


