"""On-policy distillation (opd): the policy samples, a frozen teacher scores every sampled token, and the tokens
train under ref_kl, the reverse KL to the teacher (Agarwal et al. 2024, "On-policy distillation of language
models"; Thinking Machines' "On-Policy Distillation", 2025).

The teacher is any frozen model (`teacher = { model = "<ref>" }`, served by rollout, or `{ base_url, name }`); its
logprobs come at ship time from prefill scoring of the whole sequence (`prompt_logprobs`, selected by the token id
sent), so the teacher sees exactly the tokens the policy sampled. It must share the policy's tokenizer: checked
when the run connects it (serving/tokenizers.py). No reward is needed: a sample whose reward is missing still
distills. Scoring is at temperature 1: sample at temperature 1 too, or the KL is to a sharpened teacher.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import pyarrow as pa

from rollout_lib.algo.base import Algorithm, AlgoSettings
from rollout_lib.serving.settings import FrozenModel


class OpdSettings(AlgoSettings):
    type: Literal["opd"] = "opd"
    teacher: FrozenModel


class OnPolicyDistillation(Algorithm):
    """ref_logprobs[t] = log p_teacher(x_t | x_<t) on every position; the trainer minimises, per completion token,
    the reverse-KL estimate logp_policy - logp_teacher (losses.ref_kl_loss_terms)."""

    type_name = "opd"
    settings_class = OpdSettings
    action_loss = "ref_kl"
    requires = frozenset({"served_models", "tokenizer"})

    def __init__(self, settings, resources=None, where: str = "algo"):
        super().__init__(settings, resources, where)
        self.teacher = self.resources.served_models.pool(settings.teacher, tokenizer=self.resources.tokenizer,
                                                         where=f"{where}.teacher")

    async def score(self, samples: pa.Table) -> pa.Table:
        gate = asyncio.Semaphore(self.settings.teacher.concurrency)

        async def teacher_logprobs(ids: list[int]) -> list[float]:
            async with gate:
                return [0.0, *await self.teacher.score(ids)]  # the first token has no context: never trained

        sequences = samples.column("input_ids").to_pylist()
        reference = await asyncio.gather(*(teacher_logprobs(ids) for ids in sequences))
        column = samples.schema.get_field_index("ref_logprobs")
        return samples.set_column(column, samples.schema.field(column),
                                  pa.array(reference, type=samples.schema.field(column).type))
