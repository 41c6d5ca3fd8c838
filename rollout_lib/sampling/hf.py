"""The embedded sampler: transformers `generate` on the live policy, in the training process.

Each completion token's sampling logprob is read from the scores `generate` sampled from: the logits after its
temperature and top_p processing (`output_scores=True`), so `sampling_logprobs[t] = log softmax(processed
logits)[token]` is exactly the distribution the token was drawn from. Nothing else processes the logits: the
model's own generation defaults (top_k = 50 globally, repetition penalties some checkpoints ship) are replaced
by a clean config for the call, and top_k is off.

Seeding: the global torch RNG is forked and seeded per generate call from (seed, chunk index), so a rerun with
the same seed samples the same tokens on CPU and leaves the caller's RNG state untouched.

Hardware: generation runs where the policy's weights are and in its precision (`trainer.hardware.place_model`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from rollout_lib.sampling.base import Sampler, SamplerSettings, SamplingParams, stop_token_ids
from rollout_lib.determinism import GLOBAL_RNG, derived_seed
from rollout_lib.hardware import autocast_for


class HfSamplerSettings(SamplerSettings):
    type: Literal["hf"] = "hf"
    batch_size: int = Field(64, ge=1)  # sequences per generate call (memory bound)


class HfSampler(Sampler):
    type_name = "hf"
    settings_class = HfSamplerSettings
    streams_completions = True  # a batch's completions are final when its generate call returns

    def generate(self, sequences: list[list[int]], params: SamplingParams, seed: int,
                 on_done=None) -> list[tuple[list[int], list[float]]]:
        completions: list[tuple[list[int], list[float]]] = []
        size = self.settings.batch_size
        for chunk_index, start in enumerate(range(0, len(sequences), size)):
            chunk_seed = derived_seed("hf-sampler", seed, chunk_index)
            chunk = self._generate(sequences[start:start + size], params, chunk_seed)
            if on_done is not None:
                for index, completion in enumerate(chunk, start):
                    on_done(index, completion)
            completions.extend(chunk)
        return completions

    @torch.no_grad()
    def _generate(self, sequences: list[list[int]], params: SamplingParams,
                  seed: int) -> list[tuple[list[int], list[float]]]:
        from transformers import GenerationConfig

        tokenizer, model = self.tokenizer, self.model
        stop_ids = stop_token_ids(tokenizer, model.generation_config)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        device = next(model.parameters()).device
        width = max(len(ids) for ids in sequences)
        # Left padding: every row's last prompt token sits at the same position, where generation starts.
        input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1

        sampling = ({"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
                    if params.temperature > 0 else {"do_sample": False})  # 0: greedy
        config = GenerationConfig(
            **sampling,
            max_new_tokens=params.max_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
            output_scores=True, return_dict_in_generate=True,
        )
        model_defaults, was_training = model.generation_config, model.training
        model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=pad_id)
        model.eval()
        try:
            with GLOBAL_RNG, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                with autocast_for(model):  # the precision the policy trains in (hardware.py)
                    output = model.generate(input_ids=input_ids.to(device),
                                            attention_mask=attention_mask.to(device), generation_config=config)
        finally:
            model.generation_config = model_defaults
            model.train(was_training)

        new_tokens = output.sequences[:, width:].cpu()
        scores = torch.stack(output.scores, dim=1).float().cpu()  # [B, new, vocab], as processed for sampling
        logprobs = torch.gather(torch.log_softmax(scores, dim=-1), -1, new_tokens.unsqueeze(-1)).squeeze(-1)
        stops = set(stop_ids)
        completions = []
        for row in range(len(sequences)):
            tokens = new_tokens[row].tolist()
            # Up to and including the first stop token; after it `generate` only pads.
            length = next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))
            ids = tokens[:length]
            completions.append((ids, logprobs[row, :length].tolist()))
        return completions
