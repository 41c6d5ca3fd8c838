"""What an RL task's result depends on besides the training identity and the content ids it reads (SFT's and RM's
data tasks: identity/data_keys.py): the prompts' data, and the source of user code it runs (reward functions, algorithm plugins and custom advantage functions,
environments). User code is outside the project's code version (identity/code.py), so each task's key names the
source file of every outside module it calls: editing a reward function re-scores on the next run instead of
returning old scores from cache. Only that file: helpers it imports from elsewhere are not followed.

Every function returns plain JSON for a key; a file or module that cannot be found digests as "missing" (the task
itself then reports it, naming the place).
"""

from __future__ import annotations

from rollout_lib.algo import ALGORITHMS
from rollout_lib.identity.code import PROJECT_PACKAGES
from rollout_lib.identity.digests import file_digest, prompt_source_identity
from rollout_lib.identity.training import reward_model_contents
from rollout_lib.model.loading import model_content_digest
from rollout_lib.reward.locate import find_module_spec


def module_source_digest(module: str) -> str:
    """blake3 of a module's source file, found without running it or its parent packages; "missing" when it cannot
    be found (whatever imports it later reports the unimportable module)."""
    spec = find_module_spec(module)
    return file_digest(spec.origin) if spec is not None and spec.origin else "missing"


def _env(config, name: str):
    return next(env for env in config.settings.envs if env.name == name)


def prompt_sources(config, env_name: str) -> dict:
    """What an env's prompts are made of: its source settings (and the file's digest) and how many a step draws."""
    env = _env(config, env_name)
    if env.source.type == "verifiers":  # the environment's dataset: made by its module, with its arguments
        return {"source": {**env.source.model_dump(mode="json"), "env_args": env.interaction.env_args,
                           "env_source": {module: module_source_digest(module)
                                          for module in env.interaction.user_modules()}},
                "prompts_per_step": env.prompts_per_step}
    # The data's content, not where this checkout keeps it.
    source = prompt_source_identity(env.source) or env.source.model_dump(mode="json")
    return {"source": source, "prompts_per_step": env.prompts_per_step}


def reward_sources(config) -> dict:
    """The source of each user reward function's module ("pkg.module:attr"), and each reward model's content (a
    checkpoint: its id), so a retrained reward model (`runs/<rm>/latest` moved) re-scores."""
    specs = {reward.function for env in config.settings.envs for reward in env.rewards if hasattr(reward, "function")}
    sources = {"reward_sources": {spec: module_source_digest(spec.partition(":")[0])
                                  for spec in sorted(specs) if ":" in spec}}
    # A verifiers environment's rubric functions live in its module: editing them re-scores.
    rubrics = {module for env in config.settings.envs if any(hasattr(reward, "rubric") for reward in env.rewards)
               for module in env.interaction.user_modules()}
    if rubrics:
        sources["rubric_sources"] = {module: module_source_digest(module) for module in sorted(rubrics)}
    reward_models = reward_model_contents(config)
    return {**sources, "reward_models": list(reward_models)} if reward_models else sources


def algorithm_sources(config) -> dict:
    """Algorithms outside the project (entry-point plugins) and the user functions they name (a custom algorithm's
    import path): each one's module source."""
    modules = set()
    for env in config.settings.envs:
        modules.add(ALGORITHMS[env.algo.type].__module__)
        modules.update(env.algo.user_modules())
    return {"algorithm_sources": {module: module_source_digest(module) for module in sorted(modules)
                                  if module.split(".")[0] not in PROJECT_PACKAGES}}


def interaction_sources(config) -> dict:
    """A user's environment (a custom interaction's import path, an agent program's files) and the tools an env calls
    outside the project decide the episodes: each one's source (a tool's schema is made from its source, and its
    results too)."""
    modules = {module for env in config.settings.envs if env.interaction is not None
               for module in env.interaction.user_modules()}
    modules.update(tool.module for env in config.settings.envs for tool in env.tools
                   if tool.module.split(".")[0] not in PROJECT_PACKAGES)
    files = {path for env in config.settings.envs if env.interaction is not None
             for path in env.interaction.user_files()}
    sources = {}
    if modules:
        sources["interaction_sources"] = {module: module_source_digest(module) for module in sorted(modules)}
    if files:  # an agent program's script, say (its path as the settings give it)
        sources["interaction_files"] = {path: file_digest(path) for path in sorted(files)}
    return sources


def eval_sources(config, env_name: str) -> dict:
    """What an env's held-out evaluation reads besides the policy: its settings, its prompt file, the source of user
    reward functions and the content of reward models it scores with."""
    env = _env(config, env_name)
    evaluation = env.eval
    sources = {"eval": evaluation.model_dump(mode="json")}
    sources["eval"]["source"] = prompt_source_identity(evaluation.source) or sources["eval"]["source"]
    if evaluation.source.type == "verifiers":  # the environment's eval_dataset: made by its module, with its arguments
        sources["eval"]["source"]["env_args"] = env.interaction.env_args
        sources["eval"]["source"]["env_source"] = {module: module_source_digest(module)
                                                   for module in env.interaction.user_modules()}
    for reward, dumped in zip(evaluation.rewards or (), sources["eval"]["rewards"] or ()):
        if hasattr(reward, "function") and ":" in reward.function:
            sources[reward.function] = module_source_digest(reward.function.partition(":")[0])
        if hasattr(reward, "reward_model"):
            sources[reward.reward_model.uri] = model_content_digest(reward.reward_model)
            # Where a served reward model is reached is no source. (Its replica count stays in, as it always has:
            # dropping it would change existing keys.)
            dumped.pop("base_url")
            dumped.pop("served_name")
    return sources
