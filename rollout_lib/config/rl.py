"""`rollout train rl` settings: the policy, the trainer, and one or more environments, each with its own
prompt source, reward functions, sampling settings and algorithm (per env, as in prime-rl's seed 002).

    [algorithm.rl]            base_model, max_seq_len, packing, checkpoint_interval, zero_advantage_filter,
                              chat_template (a .jinja file framing the policy's conversations instead of its own)
    [algorithm.rl.optimizer]  / .budget / .loss (the rl component's loss: type = "default" | "gspo" | "cispo" |
                              "custom", its knobs, the normaliser, the guards, the sampler-trainer mismatch
                              correction) / .reward_loop / .hardware
    [algorithm.rl.collapse]   action = "warn" | "fail" | "off", patience, zero_advantage_fraction, min_entropy: the
                              collapse guard (rl/collapse.py), outside the training identity
    [algorithm.rl.policy_sampler]  how the live policy samples: { type = "hf", batch_size } (embedded transformers)
                              | { type = "vllm", replicas, concurrency, timeout_s, probe_tolerance } (a vLLM
                              policy server reloaded to each state, sampling/vllm.py)
    [algorithm.rl.algo]       the algorithm of every env that names none (default: grpo)
    [[algorithm.rl.envs]]     name, prompts_per_step, system_prompt
      source   = { type = "jsonl_path", path = "..." } | { type = "reasoning_gym", dataset = "...", size, seed }
      sampler  = { source = "policy" } (default) | { source = <frozen model> }: where rollouts come from, the live
                 policy or a frozen model ({ model = "<ref>" } or { base_url = [...], name = "..." }, serving/settings.py)
      sampling = { group_size, temperature, top_p, max_tokens }
      interaction = { type = "calculator" | "guess_number" | "tools" | "custom" | "agent" | "openenv", ... }:
                 multi-turn episodes (openenv: an OpenEnv environment, envs/openenv_env.py)
      tools    = ["pkg.module:function", { type = "function", function = {...}, import_path = "..." }]: OpenAI-format
                 tool calls, with interaction = { type = "tools" } (envs/tool_calls.py)
      algo     = { type = "grpo" } | { type = "max_rl" } | ...   (the registry in rollout_lib/algo); for sft,
                 `teacher = <frozen model>` is its sampling source
      curriculum = { type = "difficulty_pools", easy_threshold, hard_threshold, easy_weight, hard_weight }:
                 prompts drawn away from examples always solved or never solved (rollout_lib/rl/curriculum.py)
      dynamic_sampling = { max_rounds }: groups whose rewards are all equal replaced by fresh ones (DAPO,
                 rollout_lib/rl/dynamic_sampling.py)
      [[algorithm.rl.envs.rewards]]  function = ... | reward_model = ... | judge = ... (reward/settings.py)
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from rollout_lib.algo import ALGORITHMS, algo_settings_types
from rollout_lib.envs import interaction_settings_types
from rollout_lib.envs.tools import ToolSettings
from rollout_lib.envs.verifiers_env import VerifiersSource
from rollout_lib.serving.settings import FROZEN_MODEL_TYPES, FrozenModel, PolicyOrFrozen
from rollout_lib.adapters import AdapterSettings
from rollout_lib.config.common import (
    BudgetSettings,
    EntryPointConfig,
    HardwareSettings,
    JsonlDataset,
    TableDataset,
    existing_path,
    ModelRef,
    OptimizerSettings,
    StrictModel,
)
from rollout_lib.losses import RL_LOSS_WHAT
from rollout_lib.rl_losses.correction import build_correction
from rollout_lib.rl_losses import build_rl_loss, rl_loss_settings_types
from rollout_lib.rl_losses.default import DefaultLossSettings
from rollout_lib.reward.locate import check_reference, import_reference
from rollout_lib.reward.settings import (
    RewardLoopSettings,
    RewardModelSettings,
    RewardSettings,
    RubricSettings,
)
from rollout_lib.sampling import SamplingParams, sampler_settings_types
from rollout_lib.settings_base import tagged_union
from rollout_lib.store import canonical_json


def env_locator(index: int, path: str = "") -> str:
    """The dotted locator of env `index` of an RL config, or of `path` inside it (`env_locator(0, "algo")` is
    `algorithm.rl.envs[0].algo`): the one place that spells it."""
    return f"algorithm.rl.envs[{index}]" + (f".{path}" if path else "")


AlgoChoice = tagged_union(algo_settings_types(), "algo")
SamplerChoice = tagged_union(sampler_settings_types(), "sampler")
InteractionChoice = tagged_union(interaction_settings_types(), "interaction")


class ReasoningGymSource(StrictModel):
    """A generated set from reasoning-gym: `size` items of `dataset`, seeded; scored with its score_answer."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str = Field(min_length=1)  # e.g. "basic_arithmetic", "chain_sum", "gsm_symbolic"
    size: int = Field(ge=1)
    seed: int = 0
    config: dict[str, Any] = Field(default_factory=dict)  # further dataset kwargs (difficulty knobs)


PromptSource = tagged_union((JsonlDataset, TableDataset, ReasoningGymSource, VerifiersSource), "source")


class EnvSampler(StrictModel):
    """Where an env's rollouts come from: the live policy (sampled by `policy_sampler`) or a frozen model."""

    source: PolicyOrFrozen = "policy"

    @property
    def frozen(self) -> FrozenModel | None:
        return None if self.source == "policy" else self.source


class EnvEvalSettings(StrictModel):
    """Held-out evaluation of the live policy on this env (rollout_lib/rl/evaluate.py): every prompt of `source`,
    sampled greedily by default (one completion each), scored by the env's rewards or by `rewards` (e.g. a true
    metric beside a learned reward model), before step 1, every `every` steps and at the last step. It never
    changes what trains: not part of the training identity."""

    source: PromptSource
    every: int = Field(10, ge=1)
    rewards: list[RewardSettings] | None = Field(None, min_length=1)  # default: the env's own
    # default: the env's sampling with temperature 0 (greedy) and one sample per prompt
    sampling: SamplingParams | None = None
    max_prompts: int | None = Field(None, ge=1)  # the source's first N prompts (default: all)


class DifficultyPoolsSettings(StrictModel):
    """A difficulty-pool curriculum (rollout_lib/rl/curriculum.py): an example whose last group scored
    >= easy_threshold in every sample is easy, one that scored <= hard_threshold in every sample is hard, any other
    normal; a step draws its prompts with weight easy_weight, hard_weight and 1 (normal)."""

    type: Literal["difficulty_pools"]  # required: the curriculum's kind, as an algorithm's `type`
    easy_threshold: float = 1.0  # every reward of the group >= it: easy (rewards in [0, 1]: solved every time)
    hard_threshold: float = 0.0  # every reward <= it: hard (never solved)
    easy_weight: float = Field(0.1, ge=0, le=1)  # draw weight of an easy example, a normal one's being 1
    hard_weight: float = Field(0.3, ge=0, le=1)

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> "DifficultyPoolsSettings":
        if not self.hard_threshold < self.easy_threshold:
            raise ValueError(f"hard_threshold ({self.hard_threshold}) must be < easy_threshold "
                             f"({self.easy_threshold}): a group would be easy and hard at once")
        return self


class DynamicSamplingSettings(StrictModel):
    """DAPO dynamic sampling (rollout_lib/rl/dynamic_sampling.py): a group whose rewards are all equal (no signal
    under a group-relative algorithm) is replaced by a group of a freshly drawn prompt, for up to `max_rounds`
    rounds of replacements; then the step trains on the groups it kept."""

    max_rounds: int = Field(3, ge=1)


class EnvSettings(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    source: PromptSource
    system_prompt: str | None = None  # prepended as a system message to every prompt of this env
    prompts_per_step: int = Field(ge=1)  # distinct prompts drawn per step (each sampled group_size times)
    rewards: list[RewardSettings] = Field(min_length=1)
    sampler: EnvSampler = EnvSampler()
    sampling: SamplingParams = SamplingParams()  # with an interaction, max_tokens is per model turn
    # Multi-turn: the environment answers each model turn (rollout_lib/envs); None: one model turn per rollout.
    interaction: InteractionChoice | None = None
    # OpenAI-format tools the model may call (envs/tools): shown by the chat template, run by the "tools" interaction.
    # Empty: absent from the settings' dump, so identities from before the setting stay.
    tools: list[ToolSettings] = Field(default_factory=list, exclude_if=lambda value: not value)
    algo: AlgoChoice = Field(default_factory=lambda: ALGORITHMS["grpo"].settings_class())
    eval: EnvEvalSettings | None = None  # held-out evaluation every N steps (not part of the training identity)
    # Which prompts a step draws: weighted by each example's difficulty pool (docs/environments.md, "Curriculum").
    # None: a uniform draw; then absent from the settings' dump, so identities from before the setting stay.
    curriculum: DifficultyPoolsSettings | None = Field(None, exclude_if=lambda value: value is None)
    # Groups whose rewards are all equal replaced by fresh ones (docs/algorithms.md, "DAPO dynamic sampling").
    # None: off; then absent from the settings' dump, so identities from before the setting stay.
    dynamic_sampling: DynamicSamplingSettings | None = Field(None, exclude_if=lambda value: value is None)

    @model_validator(mode="before")
    @classmethod
    def _teacher_is_the_sampling_source(cls, value: Any) -> Any:
        """`algo = { type = "sft", teacher = <frozen model> }`: an algorithm that learns a frozen model's samples
        names that model where its role is, its sampling source (seed 002's `teacher` alias, folded fill-or-agree:
        it fills `sampler.source`, or must name the same model). Folded away before validation, so both spellings
        are one training."""
        if not isinstance(value, dict) or not isinstance(value.get("algo"), dict) or "teacher" not in value["algo"]:
            return value
        algorithm = ALGORITHMS.get(value["algo"].get("type"))
        if algorithm is None or not getattr(algorithm.settings_class, "samples_from_frozen_model", False):
            return value  # opd's teacher is a field of its own settings; an unknown type fails as such
        algo = dict(value["algo"])
        teacher = algo.pop("teacher")
        sampler = dict(value.get("sampler") or {})
        if sampler.get("source", "policy") not in ("policy", teacher):
            raise ValueError(f"algo.teacher and sampler.source name different models: {algo['type']} samples from "
                             "its teacher, so give the model once")
        return {**value, "algo": algo, "sampler": {**sampler, "source": teacher}}

    @model_validator(mode="before")
    @classmethod
    def _verifiers_environment_supplies(cls, value: Any) -> Any:
        """A verifiers environment brings its prompts (its dataset) and its rewards (its rubric): left out, they are
        `source = { type = "verifiers" }` and `rewards = [{ rubric = "verifiers" }]` (envs/verifiers_env.py)."""
        if (not isinstance(value, dict) or not isinstance(value.get("interaction"), dict)
                or value["interaction"].get("type") != "verifiers"):
            return value
        value = dict(value)
        value.setdefault("source", {"type": "verifiers"})
        value.setdefault("rewards", [{"rubric": "verifiers"}])
        return value

    @model_validator(mode="after")
    def _verifiers_parts_with_its_environment(self) -> "EnvSettings":
        runs_verifiers = self.interaction is not None and self.interaction.type == "verifiers"
        if self.source.type == "verifiers" and not runs_verifiers:
            raise ValueError('source type "verifiers" is the dataset of the env\'s verifiers environment: set '
                             'interaction = { type = "verifiers", env_id = "..." }')
        if any(isinstance(reward, RubricSettings) for reward in self.rewards) and not runs_verifiers:
            raise ValueError('rewards: { rubric = "verifiers" } scores with the env\'s verifiers environment: set '
                             'interaction = { type = "verifiers", env_id = "..." }')
        if self.eval is None:
            return self
        if self.eval.source.type == "verifiers" and not runs_verifiers:
            raise ValueError('eval.source type "verifiers" is a dataset of the env\'s verifiers environment: set '
                             'interaction = { type = "verifiers", env_id = "..." }')
        if runs_verifiers and self.eval.source.type != "verifiers":
            raise ValueError("eval.source: a verifiers environment's episodes start from its own dataset rows: "
                             'eval.source = { type = "verifiers", split = "eval" } (its eval_dataset)')
        if any(isinstance(reward, RubricSettings) for reward in self.eval.rewards or ()) and not runs_verifiers:
            raise ValueError('eval.rewards: { rubric = "verifiers" } scores with the env\'s verifiers environment: '
                             'set interaction = { type = "verifiers", env_id = "..." }')
        return self

    @model_validator(mode="after")
    def _tools_with_the_tools_interaction(self) -> "EnvSettings":
        calls_tools = self.interaction is not None and self.interaction.type == "tools"
        if self.tools and not calls_tools:
            raise ValueError('tools are called through interaction = { type = "tools" }; this env has '
                             + (f"interaction type {self.interaction.type!r}" if self.interaction else "none"))
        if calls_tools and not self.tools:
            raise ValueError('interaction type "tools" needs tools = ["pkg.module:function", ...]')
        names = [tool.name for tool in self.tools]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tools: two tools named {repeated[0]!r}")
        return self

    @model_validator(mode="after")
    def _trains_on_sampled_tokens(self) -> "EnvSettings":
        if self.sampling.temperature == 0:
            raise ValueError("sampling.temperature = 0 (greedy) is for evaluation (`eval.sampling`): the trainer "
                             "scales logits by the sampling temperature")
        return self

    def eval_sampling(self) -> SamplingParams:
        """How the held-out evaluation samples: its own settings, else the env's, greedy, one per prompt."""
        if self.eval is not None and self.eval.sampling is not None:
            return self.eval.sampling
        return self.sampling.model_copy(update={"temperature": 0.0, "group_size": 1})


class CustomLossSettings(DefaultLossSettings):
    """`type = "custom"` (seed 002's `[trainer.loss] type = "custom"`): the rl component's numerator is a user
    function named by `import_path`, called with `kwargs` (losses.custom_rl_terms states its contract); eps_low,
    eps_high and kl_coef then do not apply to it (they stay in its dump, as before the loss menu), the ref_kl knobs
    and the normaliser still do. Located here, not in rollout_lib.rl_losses: it is found by import path."""

    type: Literal["custom"]
    import_path: str | None = Field(None, min_length=1)
    kwargs: dict[str, Any] = Field(default_factory=dict, exclude_if=lambda value: not value)

    @model_validator(mode="after")
    def _custom_names_its_function(self) -> "CustomLossSettings":
        if self.import_path is None:
            raise ValueError('type = "custom" needs import_path = "package.module:function"')
        if self.max_ratio is not None:
            raise ValueError('max_ratio caps the built-in losses\' ratio; a custom loss caps its own (kwargs)')
        check_reference(self.import_path, self.kwargs, what=RL_LOSS_WHAT)  # found, never run
        return self

    def user_modules(self) -> tuple[str, ...]:
        return (self.import_path.partition(":")[0],)


# The rl component's loss (rollout_lib/rl_losses: default, gspo, cispo; custom), picked by `type`, "default" when
# none is named; every variant also holds the ref_kl component's knobs and the shared guards (rl_losses/base.py).
RlLossSettings = tagged_union((*rl_loss_settings_types(), CustomLossSettings), "loss", default="default")


class CollapseSettings(StrictModel):
    """The collapse guard (rollout_lib/rl/collapse.py, docs/runs.md "When RL collapses"): a symptom held for
    `patience` consecutive steps is a collapse, said in one warning line ("warn"), or failing the run ("fail").
    It watches the steps, never changes one: not part of the training identity (identity/training.py), so changing
    it reuses every finished step."""

    action: Literal["warn", "fail", "off"] = "warn"
    patience: int = Field(3, ge=1)
    # No rl signal: at least this share of the step's rl samples has advantage 0 (`zero_advantage_fraction`; every
    # group's rewards equal, under a group-relative algorithm).
    zero_advantage_fraction: float = Field(1.0, gt=0, le=1)
    # Entropy collapse: the policy's sampled tokens' mean -logprob (`sampled_entropy`, nats per token) below this.
    # 0: not watched.
    min_entropy: float = Field(0.01, ge=0)


class PartialRolloutSettings(StrictModel):
    """Partial rollouts (rollout_lib/rl/partial.py): each policy version samples every in-flight request for at most
    `token_budget` new tokens; a request that has not ended is carried to the next version and resubmitted token-in
    (its prompt plus its tokens so far). A group trains at the step its last sample ends."""

    token_budget: int = Field(ge=1)  # new tokens per request per policy version
    # Policy versions between a sample's oldest token and the state it trains from, at most. A group that would
    # pass it if carried once more is sampled to its end in the current version instead (never dropped). None:
    # max_off_policy_steps + 1 (each group carried once at most).
    max_staleness: int | None = Field(None, ge=1)


class RlSettings(StrictModel):
    base_model: ModelRef  # the policy at step 0
    max_seq_len: int = Field(512, ge=8)  # prompt + completion tokens per training sample
    packing: bool = True
    micro_batch_tokens: int | None = Field(None, ge=8)  # tokens per packed micro-batch (default max_seq_len)
    # Packed: a group's prompt runs through the model once, not once per sample (packing.py, "Shared prefixes"):
    # the same training up to float rounding, for a fraction of the tokens. In the training identity (the bits
    # differ); off, a run trains exactly as before the setting, and it is then absent from the settings' dump, so
    # identities from before the setting stay.
    share_prompt_prefix: bool = Field(True, exclude_if=lambda value: not value)
    sequences_per_micro_batch: int = Field(8, ge=1)  # packing off: samples per padded micro-batch
    checkpoint_interval: int = Field(10, ge=1)  # a snapshot every N steps (and at the last step)
    optimizer: OptimizerSettings
    budget: BudgetSettings
    loss: RlLossSettings = DefaultLossSettings()
    policy_sampler: SamplerChoice = Field(default_factory=lambda: sampler_settings_types()[0]())
    # Step n trains on rollouts sampled from the policy of step n-1-k (the initial policy while that is < 0), so
    # step n+1 samples while step n trains (docs/serving.md, "Off-policy steps"). 0: the synchronous loop.
    max_off_policy_steps: int = Field(0, ge=0, le=8)
    # Where the importance ratio's behaviour logprobs come from: the sampler's report ("sampler"); the trainer's
    # forward of the rollouts under the weights they were sampled from ("trainer": bit-stable, so a rerun is
    # byte-identical whatever the engine's batching); or, on-policy (k = 0), the training forward's own detached
    # logprobs ("training_forward": the state that sampled is the state being trained, so the recompute is the
    # training forward again; the ratio is exactly 1 and no extra forward runs, rl/behaviour.py). "auto":
    # "training_forward" on an engine at k = 0, "trainer" when max_off_policy_steps > 0, else "sampler" (the
    # embedded sampler's logprobs are the trainer's own).
    behaviour_logprobs: Literal["auto", "sampler", "trainer", "training_forward"] = "auto"
    # Off-policy and streamed (`reward_loop.streamed`), the trainer's recompute runs while the step samples, each
    # chunk as soon as its rows are sampled (rl/behaviour_stream.py), instead of at the advantages stage: the same
    # bits, sooner. Off: every chunk at the advantages stage (to compare the two, or to keep the forwards from
    # competing with an embedded sampler for the same cores).
    overlap_behaviour_logprobs: bool = True
    reward_loop: RewardLoopSettings = RewardLoopSettings()
    # Drop samples whose only signal is rl with every advantage 0 before packing (rl/filters.py; seed 002). Off by
    # default, and then absent from the settings' dump, so identities from before the setting stay.
    zero_advantage_filter: bool = Field(False, exclude_if=lambda value: not value)
    hardware: HardwareSettings = HardwareSettings()  # device, precision, gradient checkpointing (docs/hardware.md)
    # A LoRA adapter trained instead of every weight (adapters.py, docs/scale.md). None: full fine-tuning, and then
    # absent from the settings' dump, so identities from before the setting stay.
    adapter: AdapterSettings | None = Field(None, exclude_if=lambda value: value is None)
    # Partial rollouts: requests cut at a token budget per policy version and carried to the next (rl/partial.py,
    # docs/algorithms.md "Partial rollouts"). None: off, and then absent from the settings' dump, so identities
    # from before the setting stay.
    partial_rollouts: PartialRolloutSettings | None = Field(None, exclude_if=lambda value: value is None)
    # What the run says (or does) when its steps stop carrying a learning signal; never part of the identity.
    collapse: CollapseSettings = CollapseSettings()
    # A chat template (.jinja) that frames the policy's prompts and env replies instead of its tokenizer's own (a
    # template that renders tools, for an env with `tools`; configs/templates/chatml-tools.jinja). Its content is in
    # the training identity; None: absent from the settings' dump, so identities from before the setting stay.
    chat_template: str | None = Field(None, exclude_if=lambda value: value is None)
    envs: list[EnvSettings] = Field(min_length=1)

    @field_validator("chat_template")
    @classmethod
    def _template_from_the_config(cls, path: str | None, info: ValidationInfo) -> str | None:
        return None if path is None else existing_path(path, info, what="chat template")

    @model_validator(mode="before")
    @classmethod
    def _envs_inherit_the_run_algorithm(cls, value: Any) -> Any:
        """`algorithm.rl.algo`: the algorithm of every env that names none (seed 002's run-level default). Folded
        into those envs before validation and gone from the settings, so a run that spells it per env is the same
        training; an error in it is reported at each env that inherited it (`algorithm.rl.envs[i].algo`)."""
        if not isinstance(value, dict) or "algo" not in value:
            return value
        value = dict(value)
        default = value.pop("algo")
        if isinstance(value.get("envs"), list):
            value["envs"] = [{**env, "algo": default} if isinstance(env, dict) and "algo" not in env else env
                             for env in value["envs"]]
        return value

    @model_validator(mode="after")
    def _training_forward_is_on_policy(self) -> "RlSettings":
        if self.behaviour_logprobs == "training_forward" and self.max_off_policy_steps:
            raise ValueError("behaviour_logprobs: \"training_forward\" takes the behaviour logprobs from the state "
                             "being trained, which samples only with max_off_policy_steps = 0; use \"trainer\" "
                             "(or \"auto\") for off-policy steps")
        return self

    @model_validator(mode="after")
    def _correction_reweights_the_sampler(self) -> "RlSettings":
        # The correction weighs π_old against the sampler's logprobs. π_old is the trainer's recompute under the
        # weights that sampled ("trainer", any k; the sampler's report kept beside it on the wire), this step's
        # forward ("training_forward", or "sampler" on-policy), or under partial rollouts the trainer's logprob of
        # each token under the version that drew it (rl/partial.py scores every stage's tokens when a correction is
        # set). With "sampler" off-policy and whole rollouts no stream holds π_old: the training forward is the
        # trained state, not the one that sampled, so w would fold the policy's own drift into the "mismatch" and
        # the trust region would vanish (ratio 1).
        if self.loss.correction.active and self.behaviour_logprobs_source == "sampler" and self.max_off_policy_steps \
                and self.partial_rollouts is None:
            raise ValueError(f"loss.correction {self.loss.correction.type!r} with behaviour_logprobs = \"sampler\" "
                             f"needs max_off_policy_steps = 0 (here k = {self.max_off_policy_steps}): off-policy, "
                             "π_old is the trainer's recompute; set behaviour_logprobs = \"trainer\" (or \"auto\")")
        return self

    @model_validator(mode="after")
    def _partial_rollouts_are_buildable(self) -> "RlSettings":
        """What partial rollouts need, and what this slice does not build: refused with one line each."""
        partial = self.partial_rollouts
        if partial is None:
            return self
        k = self.max_off_policy_steps
        if k < 1:
            raise ValueError("partial_rollouts: weights land while requests are in flight only with "
                             "max_off_policy_steps >= 1 (here 0): set it to 1 or more, or remove partial_rollouts")
        if partial.max_staleness is not None and partial.max_staleness < k:
            raise ValueError(f"partial_rollouts.max_staleness = {partial.max_staleness} is below what "
                             f"max_off_policy_steps = {k} needs (every token is {k} versions old when trained): "
                             f"set it to {k} or more")
        if self.behaviour_logprobs not in ("auto", "sampler"):
            raise ValueError(f"partial_rollouts: behaviour_logprobs = {self.behaviour_logprobs!r} recomputes them "
                             "under one state, and a partial sample's tokens come from several: use \"sampler\" "
                             "(the logprob each token was drawn with, by the version that drew it) or \"auto\"")
        for index, env in enumerate(self.envs):
            refused = [name for name, on in (("interaction", env.interaction is not None),
                                             ("sampler.source", env.sampler.frozen is not None),
                                             ("curriculum", env.curriculum is not None),
                                             ("dynamic_sampling", env.dynamic_sampling is not None)) if on]
            if refused:
                raise ValueError(f"partial_rollouts: env {env.name!r} sets {refused[0]}, which partial rollouts do "
                                 "not support yet (single-turn envs on the live policy only)")
        return self

    @property
    def staleness_bound(self) -> int | None:
        """Partial rollouts' staleness bound, resolved (None when they are off)."""
        partial = self.partial_rollouts
        if partial is None:
            return None
        return partial.max_staleness if partial.max_staleness is not None else self.max_off_policy_steps + 1

    @property
    def behaviour_logprobs_source(self) -> str:
        """The resolved source: "sampler", "trainer" (recomputed at the advantages stage) or "training_forward"."""
        if self.behaviour_logprobs != "auto":
            return self.behaviour_logprobs
        if self.partial_rollouts is not None:  # each token's logprob from the version that drew it
            return "sampler"
        if self.max_off_policy_steps > 0:
            return "trainer"
        return "training_forward" if self.policy_sampler.type != "hf" else "sampler"

    @property
    def recomputes_behaviour_logprobs(self) -> bool:
        return self.behaviour_logprobs_source == "trainer"

    @property
    def packed(self) -> bool:
        return self.packing

    def loss_kwargs(self) -> dict:
        """Settings of the rl and ref_kl loss components, as `losses.component_loss` takes them: the rl loss (a
        registered one, rollout_lib/rl_losses, or with a custom rl loss the user's function, imported here, where
        the step runs, with its kwargs bound), the ref_kl knobs and the rl normaliser."""
        loss = self.loss
        rl_loss = (_custom_rl_loss(loss.import_path, canonical_json(loss.kwargs)) if loss.type == "custom"
                   else build_rl_loss(loss))
        kwargs = {"rl_loss": rl_loss, "ref_kl_eps_low": loss.ref_kl_eps_low, "ref_kl_kl_coef": loss.ref_kl_kl_coef,
                  "rl_normalizer": loss.normalizer_constant()}
        correction = build_correction(loss.correction)
        return kwargs if correction is None else {**kwargs, "correction": correction}


class RlAlgorithm(StrictModel):
    kind: Literal["rl"] = "rl"
    rl: RlSettings


class RlConfig(EntryPointConfig):
    algorithm: RlAlgorithm

    @property
    def packed_tokens(self) -> int:
        return self.settings.micro_batch_tokens or self.settings.max_seq_len

    @model_validator(mode="after")
    def _reward_models_in_the_run_store(self) -> "RlConfig":
        """A reward model named as a checkpoint is looked up in the run's store unless its reward names another
        (as `base_model`, EntryPointConfig._checkpoints_in_the_run_store)."""
        eval_reward_models = [reward for env in self.settings.envs if env.eval is not None
                              for reward in env.eval.rewards or () if isinstance(reward, RewardModelSettings)]
        for reward in [reward for _, reward in self.reward_models()] + eval_reward_models:
            if reward.reward_model.store is None:
                # Settings are frozen once validated; this completes validation, it does not change a setting.
                object.__setattr__(reward, "reward_model",
                                   reward.reward_model.model_copy(update={"store": self.run.store}))
        return self

    def reward_models(self) -> list[tuple[str, RewardModelSettings]]:
        """(locator of the reference, settings) of every reward model an env scores with, in config order."""
        return [(env_locator(index, f"rewards[{r_index}].reward_model"), reward)
                for index, env in enumerate(self.settings.envs) for r_index, reward in enumerate(env.rewards)
                if isinstance(reward, RewardModelSettings)]

    def served_reward_models(self) -> list[tuple[str, RewardModelSettings]]:
        """The reward models scored on a vLLM pooling server (`engine = "vllm"`): rollout's own, or yours at
        `base_url`."""
        return [(where, reward) for where, reward in self.reward_models() if reward.engine == "vllm"]

    def frozen_models(self) -> list[tuple[str, FrozenModel]]:
        """(locator, settings) of every frozen model the run talks to, in config order: an env's sampling source
        and any frozen model its algorithm's settings name (a teacher)."""
        found = []
        for index, env in enumerate(self.settings.envs):
            where = env_locator(index)
            if env.sampler.frozen is not None:
                found.append((f"{where}.sampler.source", env.sampler.frozen))
            found.extend((f"{where}.algo.{name}", value) for name, value in frozen_fields(env.algo))
        return found + self.judges()

    def judges(self) -> list[tuple[str, FrozenModel]]:
        """(locator, settings) of every judge model an env's rewards call. Judges read text, so unlike the other
        frozen models they need not share the policy's tokenizer."""
        return [(env_locator(index, f"rewards[{r_index}].judge"), reward.judge)
                for index, env in enumerate(self.settings.envs) for r_index, reward in enumerate(env.rewards)
                if getattr(reward, "judge", None) is not None]


@functools.lru_cache(maxsize=8)
def _custom_rl_loss(import_path: str, kwargs_json: bytes):
    function = import_reference(import_path, what=RL_LOSS_WHAT)
    if not callable(function):
        raise ValueError(f"algorithm.rl.loss.import_path: {RL_LOSS_WHAT} {import_path!r} is not callable")
    return functools.partial(function, **json.loads(kwargs_json))


def frozen_fields(settings) -> list[tuple[str, FrozenModel]]:
    """(field name, value) of the frozen models among a settings block's fields."""
    return [(name, getattr(settings, name)) for name in type(settings).model_fields
            if isinstance(getattr(settings, name), FROZEN_MODEL_TYPES)]
