"""A run's rewards: one RewardLoop per distinct reward settings (each owns worker processes), the reward models
they score with (each loaded, or served, once and shared by every env that names it) and the judges they call
through the run's served models (a client of the judge's pool, or its router's address: serving/router.py)."""

from __future__ import annotations

from collections import Counter

import blake3

from rollout_lib.reward.contract import is_async_callable
from rollout_lib.reward.functions import resolve_reward_function
from rollout_lib.reward.judge import JudgeClient, LlmJudge, SyncJudgeClient, SyncWithJudge, WithJudge
from rollout_lib.reward.judge_tokenizer import judge_tokenizer
from rollout_lib.reward.loop import RewardLoop
from rollout_lib.reward.reward_model import COUNTS, RewardModelScorer, ServedRewardModelScorer, load_scorer
from rollout_lib.reward.servers import RewardServer
from rollout_lib.reward.settings import (JudgeSettings, RewardFunctionSettings, RewardLoopSettings,
                                        RewardModelSettings, RubricSettings)
from rollout_lib.reward.verl import VerlRewardFunction
from rollout_lib.store import canonical_json


class RewardLoops:
    """The reward loops of a run (they own worker processes), one per distinct reward settings, and its reward
    models (each loaded once, shared by every env that names it), created on first use and reused across steps.
    Whoever creates it closes it (`with RewardLoops(...) as loops:`)."""

    def __init__(self, settings: RewardLoopSettings, served_models=None, hardware=None):
        """`served_models` (serving.served.ServedModels): the run's, for rewards that call a judge model and reward
        models served with vLLM; `hardware` (hardware.ResolvedHardware): where embedded reward models run."""
        self.settings = settings
        self.served_models = served_models
        self.hardware = hardware
        self._loops: dict[str, RewardLoop] = {}
        self._scorers: dict[str, RewardModelScorer | ServedRewardModelScorer] = {}

    def for_rewards(self, rewards: list, where: str, rubric=None) -> RewardLoop:
        """The loop of `rewards` (a list of reward settings at the locator `where`, e.g. an env's `rewards`).
        `rubric`: (its key, a function of the weight giving [(function, weight)]) for a `{ rubric = ... }` reward,
        supplied by whoever knows the env's environment (rl/score.py: envs/verifiers_rubric.py)."""
        # A reward model's store is a locator the settings dump leaves out; two stores are two models.
        stores = [r.reward_model.store for r in rewards if isinstance(r, RewardModelSettings)]
        key = blake3.blake3(canonical_json([[r.model_dump(mode="json") for r in rewards], stores,
                                            self.settings.model_dump(mode="json"),
                                            rubric[0] if rubric is not None else None])).hexdigest()
        if key not in self._loops:
            functions = []
            for r_index, r in enumerate(rewards):
                if isinstance(r, RubricSettings):
                    if rubric is None:
                        raise ValueError(f"{where}[{r_index}]: a rubric reward scores with the env's verifiers "
                                         "environment, and this env has none")
                    functions.extend(rubric[1](r.weight))
                else:
                    functions.append((self._reward(r, f"{where}[{r_index}]"), r.weight))
            self._loops[key] = RewardLoop(functions, concurrency=self.settings.concurrency,
                                          timeout_s=self.settings.timeout_s, sync_workers=self.settings.sync_workers)
        return self._loops[key]

    def _reward(self, reward, where: str):
        if isinstance(reward, JudgeSettings):
            client = self._judge_client(reward.judge, reward.max_tokens, reward.temperature, where)
            return LlmJudge(client, reward.template, reward.pattern, reward.score_range, reward.system_prompt)
        if isinstance(reward, RewardFunctionSettings):
            return self._function(reward, where)
        return self.reward_model(reward, f"{where}.reward_model")

    def _function(self, reward: RewardFunctionSettings, where: str):
        """A reward function; with a judge, handed it: a verl-style one as verl's reward loop does (the judge's
        router address and tokenizer), ours as `judge=` (the pool's client when async; when sync, in a worker
        process, a client of the judge's router)."""
        if reward.judge is None:
            return resolve_reward_function(reward.function, reward.kwargs)
        judge_where = f"{where}.judge"

        def reward_server(taken: frozenset[str]) -> RewardServer:
            router = self._router(reward.judge, judge_where)
            tokenizer = (judge_tokenizer(reward.judge, self.served_models, judge_where)
                         if "reward_model_tokenizer" in taken else None)
            return RewardServer(router.address, tokenizer, judge_where)

        function = resolve_reward_function(reward.function, reward.kwargs, filled=("judge",),
                                           reward_server=reward_server)
        if isinstance(function, VerlRewardFunction):
            return function
        if is_async_callable(function):  # kwargs are bound already (a partial)
            return WithJudge(function, self._judge_client(reward.judge, reward.judge_max_tokens, 0.0, where), {})
        router = self._router(reward.judge, judge_where)
        model = self.served_models.pool(reward.judge, where=judge_where).model  # what the router routes by
        client = SyncJudgeClient(router.address, reward.judge_max_tokens, 0.0, judge_where, model)
        return SyncWithJudge(function, client, {})

    def _router(self, judge, where: str):
        if self.served_models is None:
            raise ValueError(f"{where}: a judge needs the run's ServedModels (RewardLoops(settings, served_models))")
        return self.served_models.router(judge, where=where)

    def reward_model(self, reward: RewardModelSettings, where: str) -> RewardModelScorer | ServedRewardModelScorer:
        """The scorer of a reward model, loaded (or served) on first use and shared by every env that names it."""
        key = canonical_json([reward.model_dump(mode="json", exclude={"weight"}), reward.reward_model.store])
        if key not in self._scorers:
            if reward.engine == "vllm" and self.served_models is None:
                raise ValueError(f"{where}: a served reward model needs the run's ServedModels "
                                 "(RewardLoops(settings, served_models))")
            self._scorers[key] = load_scorer(reward, self.served_models, where, hardware=self.hardware)
        return self._scorers[key]

    def _judge_client(self, judge, max_tokens: int, temperature: float, where: str) -> JudgeClient:
        if self.served_models is None:
            raise ValueError(f"{where}.judge: a judge needs the run's ServedModels "
                             "(RewardLoops(settings, served_models))")
        return JudgeClient(self.served_models.pool(judge, where=f"{where}.judge"), max_tokens, temperature)

    def take_reward_model_metrics(self) -> dict[str, int]:
        """`reward_model/<count>` summed over the run's reward models since the last call (none without one)."""
        counts: Counter = Counter()
        for scorer in self._scorers.values():
            counts.update(scorer.take_counts())
        return {f"reward_model/{name}": counts[name] for name in COUNTS} if self._scorers else {}

    def close(self) -> None:
        while self._loops:
            _, loop = self._loops.popitem()
            loop.close()
        while self._scorers:
            _, scorer = self._scorers.popitem()
            scorer.close()

    def __enter__(self) -> "RewardLoops":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
