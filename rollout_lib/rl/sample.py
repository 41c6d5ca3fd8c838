"""The sample stage: every env's rollouts of a step, seeded per (seed, step, env), from the env's sampler: the live
policy (the `policy_sampler` backend: embedded, or a policy server reloaded to the state) or a frozen model
(sampling/frozen.py, through a served pool). Every row records what sampled it (`sampled_from`): the policy state
id, or `frozen:<identity>`."""

from __future__ import annotations

import json
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout_lib.config.rl import RlConfig, env_locator
from rollout_lib.envs import build_interaction
from rollout_lib.envs.episodes import EpisodeError
from rollout_lib.envs.tools import ToolSetupError
from rollout_lib.errors import ConfigError
from rollout_lib.rl.prompts import select_prompts
from rollout_lib.sampling import SAMPLERS, SamplingContext
from rollout_lib.sampling.base import OnRollout
from rollout_lib.sampling.frozen import FrozenSampler
from rollout_lib.determinism import derived_seed
from rollout_lib.identity.rl_training import frozen_identity


def build_samplers(config: RlConfig, model, tokenizer, served_models=None, policy_state: str | None = None) -> dict:
    """The sampler of every env, by env name; envs on the live policy share one. `model` is the policy at
    `policy_state` (recorded in the rollouts; the engine backend loads its server with it); `served_models`
    (serving.served.ServedModels) connects the frozen ones and owns the policy server."""
    samplers, policy = {}, None
    for index, env in enumerate(config.settings.envs):
        frozen = env.sampler.frozen
        if frozen is None:
            if policy is None:
                policy = policy_sampler(config, model, tokenizer, served_models, policy_state)
            samplers[env.name] = policy
        else:
            if served_models is None:
                raise ValueError(f"{env_locator(index, 'sampler.source')}: a frozen model needs the run's ServedModels")
            pool = served_models.pool(frozen, tokenizer=tokenizer, where=env_locator(index, "sampler.source"))
            samplers[env.name] = FrozenSampler(pool, tokenizer, frozen.concurrency,
                                               sampled_from=frozen_identity(config, frozen))
    return samplers


def policy_sampler(config: RlConfig, model, tokenizer, served_models, policy_state: str | None):
    """The live policy's sampler (`algorithm.rl.policy_sampler`): embedded, or on the run's policy server (owned by
    `served_models`), for `model` at `policy_state`. The one place a policy sampler is built (sampling stages and
    held-out evaluation alike)."""
    settings = config.settings.policy_sampler
    context = SamplingContext(policy_state=policy_state, served_models=served_models,
                              base_model=config.settings.base_model)
    return SAMPLERS[settings.type](settings, model, tokenizer, context)


def env_interaction(config: RlConfig, env_index: int):
    """Env `env_index`'s interaction (None: single-turn), its tools imported; a tool that cannot be used fails here,
    naming its setting."""
    env = config.settings.envs[env_index]
    if env.interaction is None:
        return None
    try:
        return build_interaction(env.interaction, env.tools)
    except ToolSetupError as exc:
        raise ConfigError([(env_locator(env_index, f"tools[{exc.index}]"), str(exc))]) from exc


def sample_rollouts(config: RlConfig, samplers: dict, prompt_tables: dict[str, pa.Table],
                    step: int, curriculum_state: dict | None = None,
                    stream_to: Callable[[str, pa.Table], OnRollout] | None = None,
                    replacements: dict[str, pa.Table] | None = None, round_index: int = 0) -> tuple[pa.Table, dict]:
    """ROLLOUTS of every env for `step` (rewards null), and sampling metrics.

    `stream_to(env name, the env's chosen PROMPTS)`: the callback its sampler tells of each of the env's rows as
    soon as the row is final (sampling.base.RolloutRows), by its index among the env's rows (rl/streamed.py
    scores it then). The table is the same with or without it.

    `curriculum_state`: the difficulty pools to draw with (rl/curriculum.py, `{env: {example_id: pool}}`), read
    by the envs that set `curriculum`; None: every env draws uniformly. Per such env, the metrics count the
    prompts drawn from each pool (`curriculum/<env>/drawn_easy`, `/drawn_hard`).

    `replacements`: a dynamic-sampling round's prompts (rl/dynamic_sampling.py), by env, sampled with seeds of
    their own (`round_index` > 0) instead of the step's draw; envs it does not name sample nothing."""
    parts, curriculum_metrics = [], {}
    for env_index, env in enumerate(config.settings.envs):
        if replacements is not None:
            if env.name in replacements:
                parts.append(_sample_env(config, samplers, env_index, replacements[env.name], stream_to,
                                         derived_seed(config.run.seed, "sample", step, env_index, round_index)))
            continue
        difficulty = None
        if env.curriculum is not None and curriculum_state is not None:
            difficulty = curriculum_state.get(env.name, {})
        chosen = select_prompts(prompt_tables[env.name], env.prompts_per_step, seed=config.run.seed, step=step,
                                env_index=env_index, difficulty=difficulty, curriculum=env.curriculum)
        if difficulty is not None:
            pools = [difficulty.get(example_id) for example_id in chosen.column("example_id").to_pylist()]
            curriculum_metrics[f"curriculum/{env.name}/drawn_easy"] = pools.count("easy")
            curriculum_metrics[f"curriculum/{env.name}/drawn_hard"] = pools.count("hard")
        parts.append(_sample_env(config, samplers, env_index, chosen, stream_to,
                                 derived_seed(config.run.seed, "sample", step, env_index)))
    rollouts = pa.concat_tables(parts)
    return rollouts, {**rollout_metrics(config, rollouts), **curriculum_metrics}


def _sample_env(config: RlConfig, samplers: dict, env_index: int, chosen: pa.Table,
                stream_to: Callable[[str, pa.Table], OnRollout] | None, seed: int) -> pa.Table:
    """Env `env_index`'s rollouts of its `chosen` PROMPTS."""
    env = config.settings.envs[env_index]
    interaction = env_interaction(config, env_index)
    streaming = {} if stream_to is None else {"on_rollout": stream_to(env.name, chosen)}
    try:
        return samplers[env.name].sample(chosen, env.sampling, seed, interaction=interaction,
                                         context_limit=config.settings.max_seq_len, **streaming)
    except EpisodeError as exc:
        raise EpisodeError(f"{env_locator(env_index, 'interaction')}: {exc}") from exc


def rollout_metrics(config: RlConfig, rollouts: pa.Table) -> dict:
    """The sampling metrics of a step's ROLLOUTS (rollouts, lengths, truncation, entropy, turns, tool calls)."""
    lengths = [len(ids) for ids in rollouts.column("completion_ids").to_pylist()]
    max_tokens = {env.name: env.sampling.max_tokens for env in config.settings.envs}
    episodes = [json.loads(text) if text else None for text in rollouts.column("episode").to_pylist()]
    # A single-turn completion is cut when it fills max_tokens; an episode, when a model turn ends without a stop.
    truncated = sum(length >= max_tokens[env] if episode is None else episode["end"] == "truncated"
                    for length, env, episode in zip(lengths, rollouts.column("env").to_pylist(), episodes))
    metrics = {
        "rollouts": rollouts.num_rows,
        "completion_len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "truncated_fraction": truncated / len(lengths) if lengths else 0.0,
    }
    entropy = sampled_entropy(rollouts, {env.name for env in config.settings.envs if env.sampler.frozen is None})
    if entropy is not None:
        metrics["sampled_entropy"] = entropy
    multi_turn = [episode for episode in episodes if episode is not None]
    if multi_turn:
        env_tokens = sum(turn["length"] for turns in rollouts.column("completion_turns").to_pylist()
                         for turn in turns or () if not turn["sampled"])
        metrics["turns_mean"] = float(np.mean([episode["turns"] for episode in multi_turn]))
        metrics["env_token_fraction"] = env_tokens / max(sum(lengths), 1)
        metrics.update(tool_call_metrics(multi_turn))
        metrics.update(agent_metrics(multi_turn))
        metrics.update(openenv_metrics(multi_turn))
        metrics.update(verifiers_metrics(multi_turn))
    return metrics


def tool_call_metrics(episodes: list[dict]) -> dict:
    """Over the episodes of envs with tools (their records count calls): tool calls per episode, and the share of
    calls that failed (malformed, unknown tool, bad arguments, raised, timed out). Empty without such episodes."""
    with_tools = [episode for episode in episodes if "tool_calls" in episode]
    if not with_tools:
        return {}
    calls = sum(episode["tool_calls"] for episode in with_tools)
    return {"tool_calls_mean": calls / len(with_tools),
            "tool_call_error_fraction": sum(episode["tool_errors"] for episode in with_tools) / calls if calls else 0.0}


def agent_metrics(episodes: list[dict]) -> dict:
    """Over the episodes of agent envs (their records count training sequences, envs/agent_tokens.py): how many
    times a request did not extend its episode's tokens (a new training sequence; the earlier ones are not trained),
    and how many agents failed (raised, timed out: their rewards are missing). Empty without such episodes."""
    agents = [episode for episode in episodes if "sequences" in episode]
    if not agents:
        return {}
    return {"agent_sequence_splits": sum(max(episode["sequences"] - 1, 0) for episode in agents),
            "agent_failures": sum(bool(episode["state"].get("episode_error")) for episode in agents),
            "agent_requests_mean": float(np.mean([episode["turns"] for episode in agents]))}


def openenv_metrics(episodes: list[dict]) -> dict:
    """Over the episodes of OpenEnv envs (envs/openenv_env.py; their states count steps and action errors): how many
    failed (the environment raised, its server died: their rewards are missing), environment steps per episode, and
    turns whose action the environment did not take (none written, or refused) per episode. Empty without them."""
    ours = [episode["state"] for episode in episodes if {"env_reward", "action_errors"} <= set(episode["state"])]
    if not ours:
        return {}
    return {"env_failures": sum(bool(state.get("episode_error")) for state in ours),
            "env_steps_mean": float(np.mean([state["steps"] for state in ours])),
            "env_action_errors_mean": float(np.mean([state["action_errors"] for state in ours]))}


def verifiers_metrics(episodes: list[dict]) -> dict:
    """Over the episodes of verifiers environments (their records keep the environment's final state,
    envs/verifiers_client.py): how many ended on a verifiers error (a model response it refused, a tool that stopped
    it: `verifiers_errors`) and how many because a prompt outgrew the context (`verifiers_prompt_too_long`); the
    rubric still scores them, as verifiers does. Empty without such episodes."""
    states = [episode["state"]["verifiers"] for episode in episodes if "verifiers" in episode["state"]]
    if not states:
        return {}
    return {"verifiers_errors": sum(state.get("error") is not None for state in states),
            "verifiers_prompt_too_long": sum(bool(state.get("prompt_too_long")) for state in states)}


def sampled_entropy(rollouts: pa.Table, policy_envs: set[str]) -> float | None:
    """The mean -logprob of the tokens the live policy sampled (rows of `policy_envs`; tokens an environment wrote
    have no logprob): an estimate of the policy's entropy per token at the sampling temperature, which falls to ~0
    when it samples one continuation whatever the seed (rl/collapse.py watches it). None without such tokens."""
    rows = rollouts.filter(pc.is_in(rollouts.column("env"), pa.array(sorted(policy_envs), pa.string())))
    logprobs = pc.list_flatten(rows.column("sampling_logprobs")).drop_null().cast(pa.float64())
    return float(-np.mean(logprobs.to_numpy())) if len(logprobs) else None


def reload_metrics(samplers) -> dict:
    """The policy server's work for a stage (engine backend only): seconds spent reloading and checking weights,
    and the largest probe difference a reload left (serving/policy_server.py)."""
    reports = {id(sampler): sampler for sampler in samplers if hasattr(sampler, "hold_reports")}
    holds = [report for sampler in reports.values() for report in sampler.hold_reports if report.reloaded]
    if not reports:
        return {}
    metrics = {"policy_server/reload_s": sum(report.seconds for report in holds),
               "policy_server/write_s": sum(report.write_seconds for report in holds),
               "policy_server/reloads": len(holds)}
    if holds:
        metrics["policy_server/probe_diff"] = max(report.max_probe_diff for report in holds)
    return metrics
