"""On-policy self-distillation (opsd; SDFT, arXiv:2601.19897): the reference is the policy itself, shown a
demonstration of the answer as a hint. The policy samples without the hint; each sampled token is then scored by
the hint-conditioned reference, and trains under ref_kl toward it: the policy learns to answer as it would if it
had seen the demonstration, without seeing it.

The demonstration is the prompt row's `info[demo_key]`, placed by `hint_placement` and cut to `max_hint_tokens`
(the problem never is). `reference`: "policy" (default: the live policy at the weights the samples were drawn
from, the SDFT setting), "initial" (the frozen base) or a frozen model sharing the policy's tokenizer; the first
two are scored in process at temperature 1 (deterministic on CPU, so a resumed run reproduces them), a frozen model
by prefill through its pool. In full: docs/algorithms.md, "opsd".
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pyarrow as pa
from pydantic import Field

from rollout_lib.algo.base import Algorithm, AlgoSettings, MissingResourceError
from rollout_lib.serving.settings import FROZEN_MODEL_TYPES, named_or_frozen

OpsdReference = named_or_frozen("policy", "initial")


class OpsdSettings(AlgoSettings):
    type: Literal["opsd"] = "opsd"
    demo_key: str = Field("demo", min_length=1)  # key of the demonstration in each prompt row's info
    hint_placement: Literal["user", "system"] = "user"
    hint_template: str = "Here is an example of a good answer:\n{demo}"
    max_hint_tokens: int = Field(256, ge=1)
    # "policy" by default, as the seed has it. Its target drifts with the policy: on the tiny model taught to copy a
    # hint that collapsed within 9 steps (reward 0.46 -> 0.04) where "initial" learned (0.08 -> 0.8), and the seed
    # reports the same drift over long runs; "initial" or a frozen model is the fixed target (docs/algorithms.md).
    reference: OpsdReference = "policy"


class OnPolicySelfDistillation(Algorithm):
    """ref_logprobs[t] = log p_ref(x_t | hint-conditioned prompt, x_<t) on completion tokens (0 on the prompt)."""

    type_name = "opsd"
    settings_class = OpsdSettings
    action_loss = "ref_kl"
    requires = frozenset({"tokenizer", "prompts", "policy"})

    def __init__(self, settings, resources=None, where: str = "algo"):
        super().__init__(settings, resources, where)
        self._initial_model = None
        self._frozen = None
        if isinstance(settings.reference, FROZEN_MODEL_TYPES):
            if self.resources.served_models is None:
                raise MissingResourceError(f"{where}: an opsd algorithm with a frozen reference is built with the "
                                           "run's served_models, and none was given")
            self._frozen = self.resources.served_models.pool(settings.reference, tokenizer=self.resources.tokenizer,
                                                             where=f"{where}.reference")

    async def score(self, samples: pa.Table) -> pa.Table:
        from rollout_lib.model.chat import encode_prompt

        tokenizer = self.resources.tokenizer
        rows_by_example = self._prompt_rows(samples.column("env")[0].as_py() if samples.num_rows else "")
        jobs = []
        for sample_id, ids, mask in zip(samples.column("sample_id").to_pylist(),
                                        samples.column("input_ids").to_pylist(),
                                        samples.column("loss_mask").to_pylist()):
            n_prompt = mask.index(True) if True in mask else len(ids)
            row = rows_by_example[sample_id.rsplit("#", 1)[0]]
            jobs.append((n_prompt, encode_prompt(tokenizer, self._hinted_messages(row)), ids[n_prompt:]))
        if self._frozen is None:
            model = self._reference_model()
            scored = [completion_logprobs(model, hinted, completion) for _, hinted, completion in jobs]
        else:
            gate = asyncio.Semaphore(self.settings.reference.concurrency)
            scored = await asyncio.gather(*(self._frozen_logprobs(gate, hinted, completion)
                                            for _, hinted, completion in jobs))
        reference = [[0.0] * n_prompt + logprobs for (n_prompt, _, _), logprobs in zip(jobs, scored)]
        column = samples.schema.get_field_index("ref_logprobs")
        field = samples.schema.field(column)
        return samples.set_column(column, field, pa.array(reference, type=field.type))

    async def _frozen_logprobs(self, gate, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        if not completion_ids:
            return []
        async with gate:
            # The pool's prefill logprobs are of tokens 1..n: the completion's are the last len(completion_ids).
            return (await self._frozen.score(prompt_ids + completion_ids))[-len(completion_ids):]

    def _prompt_rows(self, env: str) -> dict[str, dict]:
        return {row["example_id"]: row for row in self.resources.prompts[env].to_pylist()}

    def _hinted_messages(self, row: dict) -> list[dict]:
        info = json.loads(row["info"]) if row["info"] else {}
        if self.settings.demo_key not in info:
            line = f" (line {row['source_line']})" if row.get("source_line") else ""
            raise ValueError(f"{self.where}: prompt {row['example_id']!r}{line} has no info[{self.settings.demo_key!r}],"
                             " the demonstration opsd conditions its reference on")
        hint = self.settings.hint_template.format(demo=self._cut(str(info[self.settings.demo_key])))
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        if self.settings.hint_placement == "system":
            if messages and messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{hint}"}
            else:
                messages.insert(0, {"role": "system", "content": hint})
        else:
            last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[last_user] = {"role": "user", "content": f"{messages[last_user]['content']}\n\n{hint}"}
        return messages

    def _cut(self, demo: str) -> str:
        ids = self.resources.tokenizer(demo, add_special_tokens=False)["input_ids"]
        if len(ids) <= self.settings.max_hint_tokens:
            return demo
        return self.resources.tokenizer.decode(ids[:self.settings.max_hint_tokens])

    def _reference_model(self):
        if self.settings.reference == "policy":
            return self.resources.policy.model
        if self._initial_model is None:
            self._initial_model = self.resources.policy.initial_model()
        return self._initial_model


def completion_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """log p(completion_t | prompt, completion_<t) under `model` at temperature 1 (no gradient)."""
    import torch

    if not completion_ids:
        return []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            ids = torch.tensor([prompt_ids + completion_ids], device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:-1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(completion_ids, device=device).unsqueeze(-1)
            return logprobs.gather(-1, targets).squeeze(-1).cpu().tolist()
    finally:
        model.train(was_training)
