"""RL's plan checks: what refuses an RL config before anything runs (names and kwargs that cannot resolve, settings
that contradict each other), and the warnings for settings that run but are probably not what was meant."""

from __future__ import annotations

from rollout_lib.algo import ALGORITHMS
from rollout_lib.algo.base import trains_env_tokens
from rollout_lib.config.rl import EnvSettings, ReasoningGymSource, env_locator
from rollout_lib.reward.functions import check_reward_function
from rollout_lib.reward.settings import RewardFunctionSettings
from rollout_lib.store import is_process_local


def rl_warnings(config) -> list[tuple[str, str]]:
    """Settings that run but are probably not what was meant."""
    found = []
    for index, env in enumerate(config.settings.envs):
        where = env_locator(index)
        if type(env.algo).group_relative and env.sampling.group_size == 1:
            found.append((f"{where}.sampling.group_size",
                          f"{env.algo.type} is group-relative: with group_size = 1 every advantage is 0 and "
                          "the env never trains"))
        if env.sampler.frozen is not None and ALGORITHMS[env.algo.type].action_loss == "rl":
            found.append((f"{where}.sampler.source",
                          f"{env.algo.type} trains the rl component on rollouts of a frozen model: importance "
                          "ratios are against that model's logprobs, so every step is off-policy"))
        if trains_env_tokens(ALGORITHMS[env.algo.type]) and env.interaction is None:
            found.append((f"{where}.algo",
                          f"{env.algo.type} trains on tokens the environment writes, and this env has no "
                          "interaction (single-turn): it trains exactly as grpo"))
        if env.sampling.top_p != 1.0:
            # Temperature is matched (the trainer scales each token's logits by it); the nucleus is not.
            found.append((f"{where}.sampling.top_p",
                          "top_p != 1: sampling logprobs are those of the truncated distribution, the "
                          "trainer's are not, so importance ratios are off-policy by construction"))
    return found


def rl_problems(config) -> list[tuple[str, str]]:
    """Problems found at plan time, before any model loads: names and kwargs that cannot resolve (besides those
    of every entry point, checks.common_problems)."""
    settings = config.settings
    judges = {where for where, _ in config.judges()}
    problems = [(f"{where}.runner", "'pooling' serves a reward model: only a reward function's judge may name one")
                for where, frozen in config.frozen_models()
                if getattr(frozen, "runner", "generate") != "generate" and where not in judges]
    names = [env.name for env in settings.envs]
    for index, env in enumerate(settings.envs):
        where = env_locator(index)
        if names.count(env.name) > 1:
            problems.append((f"{where}.name", f"env name {env.name!r} is used more than once"))
        for r_index, reward in enumerate(env.rewards):
            if not isinstance(reward, RewardFunctionSettings):
                continue  # a reward model resolves against the store (identity/training.py); a judge connects
            try:
                check_reward_function(reward.function, reward.kwargs,
                                      filled=("judge",) if reward.judge is not None else ())
            except ValueError as exc:
                problems.append((f"{where}.rewards[{r_index}].function", str(exc)))
        if isinstance(env.source, ReasoningGymSource):
            known = _reasoning_gym_datasets()
            if env.source.dataset not in known:
                examples = ", ".join(d for d in ("basic_arithmetic", "chain_sum", "gsm_symbolic") if d in known)
                problems.append((f"{where}.source.dataset",
                                 f"no reasoning-gym dataset {env.source.dataset!r} (e.g. {examples})"))
        if getattr(type(env.algo), "samples_from_frozen_model", False) and env.sampler.frozen is None:
            problems.append((f"{where}.sampler.source",
                             f"{env.algo.type} distils a frozen model's samples: set sampler.source to a frozen "
                             "model ({ model = \"<ref>\" } or { base_url = [...], name = \"...\" }); ce on the "
                             "policy's own samples is a different algorithm"))
        if settings.loss.correction.active and env.sampler.frozen is not None \
                and ALGORITHMS[env.algo.type].action_loss == "rl":
            problems.append((f"{where}.sampler.source",
                             f"loss.correction {settings.loss.correction.type!r} compares the policy's sampler "
                             "with its trainer; a frozen model's logprobs are another policy's, never the "
                             "trainer's: sample this env from the policy or set correction type = \"none\""))
        if env.dynamic_sampling is not None:
            problems += _dynamic_sampling_problems(env, where)
        if env.sampling.max_tokens >= settings.max_seq_len:
            problems.append((f"{where}.sampling.max_tokens", f"must be < algorithm.rl.max_seq_len "
                             f"({settings.max_seq_len}) to leave room for the prompt"))
    if getattr(settings.policy_sampler, "base_url", None) and is_process_local(config.run.store):
        problems.append(("algorithm.rl.policy_sampler.base_url",
                         "policy servers at a URL read each state's weights from the run's store themselves, and "
                         f"run.store = {config.run.store!r} is this process's memory, which no server reaches: set "
                         "run.store to a directory or bucket those servers read too (a shared filesystem, "
                         "s3://...), or leave base_url out to serve the policy on this machine"))
    if settings.micro_batch_tokens is not None and settings.micro_batch_tokens < settings.max_seq_len:
        problems.append(("algorithm.rl.micro_batch_tokens", f"must be >= max_seq_len ({settings.max_seq_len})"))
    return problems


def _dynamic_sampling_problems(env: EnvSettings, where: str) -> list[tuple[str, str]]:
    problems = []
    if env.sampling.group_size == 1:
        problems.append((f"{where}.dynamic_sampling", "with sampling.group_size = 1 every group is uniform and "
                         "would be replaced"))
    return problems


def _reasoning_gym_datasets() -> set[str]:
    from reasoning_gym.factory import DATASETS

    return set(DATASETS)
