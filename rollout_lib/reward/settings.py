"""The reward settings an env names (`[[algorithm.rl.envs.rewards]]`) and the reward loop's own
(`[algorithm.rl.reward_loop]`): owned by the reward room, composed into RL settings by config/rl.py.

    function = "number_match" | "pkg.module:attr", weight, kwargs, judge (a model the function may call)
    reward_model = "runs/rm/latest" | <checkpoint id> | <model ref>, weight, store, batch_size, max_length,
                   engine = "embedded" | "vllm", replicas,         (a discriminative reward model)
                   base_url = "http://node2:8000/v1" | [...], served_name   (served by you, on vLLM's pooling runner)
    judge = <frozen model>, template, pattern, score_range, ...    (a generative judge)
    rubric = "verifiers", weight                                   (the env's verifiers Rubric: every function)
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from rollout_lib.serving.settings import BaseUrls, FrozenModel
from rollout_lib.settings_base import GpuList, ModelRef, StrictModel, replica_gpus_problem


class RewardFunctionSettings(StrictModel):
    function: str = Field(min_length=1)  # a built-in name or an import path "package.module:attr"
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)
    # A judge model the function may call: ours is called as fn(inp, judge=<client>, **kwargs) (reward/judge.py:
    # `await judge.chat(messages)` through the run's replica pool; sync, `judge.chat(messages)` through its router);
    # a verl-style one gets reward_router_address and reward_model_tokenizer (reward/verl.py).
    judge: FrozenModel | None = None
    judge_max_tokens: int = Field(256, ge=1)


DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the response answers the question, from 0 (useless or wrong) to 10 (perfect).\n\n"
    "Question:\n{prompt}\n\nResponse:\n{response}\n\nEnd with a line of the form 'Score: <0-10>'."
)


class JudgeSettings(StrictModel):
    """A generative reward model (reward/judge.py): the judge model reads `template` filled with the rollout's
    {prompt}, {response} and {answer}, and its verdict's last match of `pattern` is the score, scaled from
    `score_range` to [0, 1]. A verdict that does not parse is a missing reward carrying the judge's text."""

    judge: FrozenModel
    template: str = DEFAULT_JUDGE_TEMPLATE
    system_prompt: str | None = None
    pattern: str = r"Score:\s*(-?\d+(?:\.\d+)?)"  # its first group (or whole match) is the number
    score_range: tuple[float, float] = (0.0, 10.0)
    max_tokens: int = Field(256, ge=1)  # of the verdict
    temperature: float = Field(0.0, ge=0)  # greedy: the same rollout gets the same verdict
    weight: float = 1.0

    @model_validator(mode="after")
    def _checked(self) -> "JudgeSettings":
        import re

        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"pattern is not a regular expression: {exc}") from None
        if not self.score_range[0] < self.score_range[1]:
            raise ValueError(f"score_range must be [low, high] with low < high, got {list(self.score_range)}")
        if "{response}" not in self.template:
            raise ValueError("template has no {response}: the judge would never see what it judges")
        if getattr(self.judge, "runner", "generate") != "generate":
            raise ValueError("judge.runner = 'pooling' serves a reward model, which writes no verdict: name it as "
                             "`reward_model = ...`, or as the judge of a reward function that calls /classify")
        return self


class RewardModelSettings(StrictModel):
    """A discriminative reward model's score of (prompt, completion), as train-rm trained it to score
    (rollout_lib/reward/reward_model.py): a checkpoint of the store (`runs/<name>/latest` or an id, looked up in the
    run's store unless `store` names another) or any model reference to a sequence-classification model."""

    reward_model: ModelRef
    weight: float = 1.0
    batch_size: int = Field(16, ge=1)  # rows per forward pass (every pass has this many: see reward_model.py)
    # Tokens per input; a longer one loses the prompt's earliest tokens. Default: the max_seq_len the checkpoint was
    # trained with when its manifest records it, else the model's max_position_embeddings.
    max_length: int | None = Field(None, ge=8)
    # embedded: in this process. vllm: rollout serves it with vLLM's pooling runner (`POST /classify`); not bit for
    # bit the embedded scores, so the engine is part of the training identity (docs/rewards.md).
    engine: Literal["embedded", "vllm"] = "embedded"
    replicas: int = Field(1, ge=1)  # vllm servers behind the pool (a resource: not part of the identity)
    # Pooling servers of this model that you run (one URL or its replicas'): rollout only connects. Implies engine =
    # "vllm", the same identity (an address is a resource); the reference still names the model (docs/rewards.md).
    # `served_name`: the model name that server serves, if not the one its /v1/models lists.
    base_url: BaseUrls | None = None
    served_name: str | None = Field(None, min_length=1)
    gpus: GpuList = Field(None, min_length=1)  # the GPUs of rollout's own pooling replicas (engine = "vllm")

    # Where the model runs, never what it computes: not part of the training identity (config/rl.py).
    RESOURCES: ClassVar[tuple[str, ...]] = ("replicas", "base_url", "served_name", "gpus")

    @model_validator(mode="before")
    @classmethod
    def _served_at_a_url_is_vllm(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("base_url") is not None and "engine" not in value:
            value = {**value, "engine": "vllm"}
        return value

    @model_validator(mode="after")
    def _replicas_are_served(self) -> "RewardModelSettings":
        if self.base_url is not None:
            if self.engine != "vllm":
                raise ValueError('base_url is the address of a vLLM pooling server, and engine = "embedded" scores '
                                 "in this process: drop one of them")
            if self.replicas > 1:  # (1 is every reward's value once dumped: `config show` must validate back)
                raise ValueError("replicas is how many servers rollout starts, and base_url names servers you run: "
                                 "list each replica's URL in base_url instead")
        elif self.served_name is not None:
            raise ValueError("served_name is the model name a server at base_url serves: give base_url with it")
        if self.replicas > 1 and self.engine != "vllm":
            raise ValueError('replicas is the number of vLLM servers: set engine = "vllm" with it')
        if self.gpus is not None and self.engine != "vllm":
            raise ValueError('gpus places the vLLM servers rollout starts for this reward model: set engine = "vllm" '
                             "with it (the embedded scorer runs on the trainer's device)")
        problem = replica_gpus_problem(self.gpus, self.replicas, remote=self.base_url is not None)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="before")
    @classmethod
    def _store_into_the_reference(cls, value: Any) -> Any:
        """`store = "<url>"` beside the reference is where the reference is looked up: it belongs to the ModelRef
        (a locator, never part of the settings' identity; the checkpoint id is)."""
        if not isinstance(value, dict) or "store" not in value:
            return value
        value = dict(value)
        store = value.pop("store")
        reference = value.get("reward_model")
        if isinstance(reference, dict):
            if reference.get("store") is not None:
                raise ValueError("give the store once: `store` beside `reward_model`, or inside it")
            value["reward_model"] = {**reference, "store": store}
        elif reference is not None:
            value["reward_model"] = {"uri": reference, "store": store}
        return value


class RubricSettings(StrictModel):
    """The reward functions of the env's verifiers environment's Rubric (envs/verifiers_rubric.py), each with its
    rubric weight times `weight`; only with `interaction = { type = "verifiers", ... }`, whose environment it is."""

    rubric: Literal["verifiers"]
    weight: float = 1.0


def _reward_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        if "function" in value:  # a function may name a judge it calls
            return None if "reward_model" in value else "reward(function)"
        kinds = [kind for kind in ("reward_model", "judge", "rubric") if kind in value]
        return f"reward({kinds[0]})" if len(kinds) == 1 else None
    return {RewardFunctionSettings: "reward(function)", RewardModelSettings: "reward(reward_model)",
            JudgeSettings: "reward(judge)", RubricSettings: "reward(rubric)"}.get(type(value))


RewardSettings = Annotated[
    Union[Annotated[RewardFunctionSettings, Tag("reward(function)")],  # noqa: UP007
          Annotated[RewardModelSettings, Tag("reward(reward_model)")],
          Annotated[JudgeSettings, Tag("reward(judge)")],
          Annotated[RubricSettings, Tag("reward(rubric)")]],
    Discriminator(_reward_kind, custom_error_type="unknown_reward",
                  custom_error_message="a reward names one of `function` (a reward function), `reward_model`, "
                                       "`judge` (an LLM judge) and `rubric` (a verifiers environment's)")]


class RewardLoopSettings(StrictModel):
    concurrency: int = Field(32, ge=1)  # reward calls in flight
    timeout_s: float = Field(30.0, gt=0)  # per call; the call is stopped (worker killed / task cancelled)
    sync_workers: int | None = Field(None, ge=1)  # worker processes for sync functions (default: min(cores, ...))
    # The circuit breaker: a step with a larger share of missing rewards fails, naming its most frequent errors.
    # 0.5: past it the step would train on the rollouts the failure spared, not the sampled batch. 1.0: only a step
    # where every reward is missing fails.
    max_missing_fraction: float = Field(0.5, ge=0, le=1)
    # Score each rollout as soon as it is sampled, while the step samples on (seed 004's agent reward loop), instead
    # of after the step's last rollout. The same rewards either way, so not part of the training identity. A run
    # with a dask or ray task runner scores in chunks after sampling whatever this says (docs/rewards.md).
    streamed: bool = True
