"""Sampling from a frozen model behind an OpenAI-compatible pool (rollout_lib/serving), with the ROLLOUTS contract
of every sampler (base.py).

Prompts are sent as token ids, encoded by the policy's tokenizer (which the served model shares: checked when
the pool connects, serving/tokenizers.py), so the rollouts' prompt_ids are exactly what the policy trains on.
Each completion is its own request with its own seed, derived from (seed, prompt row, group index): the tokens
do not depend on how requests are batched, ordered or retried on another replica, so a step re-run after an
interruption samples the same tokens (its logprobs may differ in the last bits: the engine's float sums depend
on batch composition, ../shared/notes/serving.md).

Not registered as a policy backend: it is built per env for `sampler.source = <frozen model>`. Its rows record
`sampled_from = "frozen:<identity>"` (rl/sample.py: the served name of a server you run, the checkpoint id or
content digest of a model rollout serves): what identifies the weights, never where they run.
"""

from __future__ import annotations

import asyncio

import pyarrow as pa

from rollout_lib.sampling.base import (
    OnRollout,
    RolloutRows,
    SamplingParams,
    encode_prompt,
    prompt_messages,
    sample_episodes,
    stop_token_ids,
)
from rollout_lib.determinism import derived_seed


class FrozenSampler:
    """Rollouts of a frozen served model: `pool` is a started serving.pool.EndpointPool."""

    samples_live_policy = False

    def __init__(self, pool, tokenizer, concurrency: int, sampled_from: str | None = None):
        self.pool = pool
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.sampled_from = sampled_from

    def sync(self) -> None:
        """A frozen model's weights never move: nothing to sync."""

    def sample(self, prompts: pa.Table, params: SamplingParams, seed: int, interaction=None,
               context_limit: int | None = None, on_rollout: OnRollout | None = None) -> pa.Table:
        """As every sampler's (base.Sampler.sample): `on_rollout` is told of each row as its request returns."""
        tools = interaction.tool_schemas if interaction is not None else None  # an env's tools frame its prompts
        prompt_ids = [encode_prompt(self.tokenizer, messages, tools) for messages in prompt_messages(prompts)]
        if interaction is not None:
            return sample_episodes(self.generate, self.tokenizer, interaction, prompts, prompt_ids, params, seed,
                                   stop_token_ids(self.tokenizer), context_limit, self.sampled_from,
                                   on_rollout=on_rollout)
        rows = RolloutRows(prompts, params.group_size, prompt_ids, sampled_from=self.sampled_from,
                           on_rollout=on_rollout)
        asyncio.run(self._generate_all(prompt_ids, params, seed, rows))
        return rows.table()

    def generate(self, sequences: list[list[int]], params: SamplingParams,
                 seed: int) -> list[tuple[list[int], list[float]]]:
        """One model turn for each sequence, each request seeded by (seed, its index): an episode's turn does not
        depend on which replica answers it or in which order."""
        gate = asyncio.Semaphore(self.concurrency)
        stops = stop_token_ids(self.tokenizer)

        async def one(index: int):
            async with gate:
                return await self.pool.generate(
                    sequences[index], max_tokens=params.max_tokens, temperature=params.temperature,
                    top_p=params.top_p, seed=derived_seed("frozen-turn", seed, index), stop_token_ids=stops)

        async def every():
            return await asyncio.gather(*(one(index) for index in range(len(sequences))))

        return [(g.token_ids, g.logprobs) for g in asyncio.run(every())]

    async def _generate_all(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int,
                            rows: RolloutRows) -> None:
        gate = asyncio.Semaphore(self.concurrency)
        stops = stop_token_ids(self.tokenizer)

        async def one(row: int, group_index: int):
            async with gate:
                g = await self.pool.generate(
                    prompt_ids[row], max_tokens=params.max_tokens, temperature=params.temperature,
                    top_p=params.top_p, seed=derived_seed("frozen-sampler", seed, row, group_index),
                    stop_token_ids=stops)
            # Placed by its prompt-major index, whatever order requests finish in.
            rows.add(row * params.group_size + group_index, g.token_ids, g.logprobs,
                     self.tokenizer.decode(g.token_ids, skip_special_tokens=True))

        await asyncio.gather(*(one(row, g) for row in range(len(prompt_ids)) for g in range(params.group_size)))
