"""RL's projection of its settings into the training identity (identity/training.py `training_settings` calls it by
name), and what identifies a frozen model's rollouts: kept apart so that SFT and RM code never imports RL's."""

from __future__ import annotations

from rollout_lib.config.rl import env_locator, frozen_fields
from rollout_lib.identity.digests import prompt_source_identity
from rollout_lib.identity.sources import module_source_digest
from rollout_lib.identity.training import content_identity, run_store
from rollout_lib.reward.settings import RewardModelSettings
from rollout_lib.serving.settings import ExternalModel


def rl_training_settings(config, settings: dict) -> dict:
    """RL's: a frozen model enters as what identifies its content (the served name, or for a model rollout serves,
    nothing here: identity.training adds its content digest), never as its addresses, timeouts or replica count."""
    rl = config.settings
    # The circuit breaker decides whether a step fails, never what a step that runs trains.
    settings["reward_loop"].pop("max_missing_fraction")
    # Scoring each rollout as it is sampled or after the last changes when a reward is computed, never its value.
    settings["reward_loop"].pop("streamed")
    settings["policy_sampler"] = rl.policy_sampler.identity_settings()
    # What the logprobs are, not how it was spelt: "auto" and the value it resolves to are one training. At their
    # defaults (k = 0, the sampler's logprobs) both are left out: the synchronous loop's identity is as it was
    # before they existed.
    settings.pop("behaviour_logprobs")
    # Computing the behaviour logprobs while sampling or after changes when they are computed, never their bits.
    settings.pop("overlap_behaviour_logprobs")
    if rl.behaviour_logprobs_source != "sampler":
        settings["behaviour_logprobs"] = rl.behaviour_logprobs_source
    if not settings["max_off_policy_steps"]:
        settings.pop("max_off_policy_steps")
    # Whether a run stops after non-finite steps, never what a step that runs trains (a skipped step is skipped
    # whatever the limit).
    settings["loss"].pop("max_nonfinite_steps")
    if rl.loss.type == "custom":  # the function's source decides the weights as much as its name
        settings["loss"]["source"] = module_source_digest(rl.loss.user_modules()[0])
    for dumped in settings["envs"]:
        dumped.pop("eval")  # evaluation watches the policy, it never changes it
    for index, (env, dumped) in enumerate(zip(rl.envs, settings["envs"])):
        # The prompts' content, not where this checkout keeps them.
        dumped["source"] = prompt_source_identity(env.source, env_locator(index, "source")) or dumped["source"]
        if env.sampler.frozen is not None:
            dumped["sampler"]["source"] = env.sampler.frozen.identity_settings()
        for name, value in frozen_fields(env.algo):
            dumped["algo"][name] = value.identity_settings()
        for reward, dumped_reward in zip(env.rewards, dumped["rewards"]):
            if getattr(reward, "judge", None) is not None:
                dumped_reward["judge"] = reward.judge.identity_settings()
            if isinstance(reward, RewardModelSettings):
                for resource in reward.RESOURCES:  # served by rollout or at a URL: the same engine's scores
                    dumped_reward.pop(resource)
                if reward.engine == "embedded":  # absent, so identities from before the setting stay
                    dumped_reward.pop("engine")
    return settings


def frozen_identity(config, frozen) -> str:
    """`sampled_from` of a frozen model's rollouts: what identifies its weights (as in the training identity), never
    where it runs: `frozen:served:<name>` for a server you run, `frozen:checkpoint:<id>` or `frozen:<content
    digest>` for one rollout serves."""
    if isinstance(frozen, ExternalModel):
        return f"frozen:served:{frozen.name}"
    return f"frozen:{content_identity(frozen.model, run_store(config))}"
