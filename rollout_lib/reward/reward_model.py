"""A discriminative reward model as a reward: train-rm's scalar score of (prompt, completion), in-process, batched.

`RewardModelScorer` is an async callable, so the reward loop calls it like any async reward function: once per
rollout, on its event loop, many calls at a time. The scorer gathers the calls waiting into batches and runs the
model in one worker thread of its own, so the event loop (and every other reward) goes on meanwhile. It is loaded
once per run (`reward.loops.RewardLoops` keeps it across steps). `ServedRewardModelScorer` encodes the same way and
sends the batches to a vLLM pooling server instead (`engine = "vllm"`, for a model too large to run beside the
trainer): one rollout serves, or one you run on another node (`base_url`).

What it scores: the env's prompt messages (system prompt included), then the completion as the assistant's turn
(in a multi-turn episode, the policy's last turn), encoded as train-rm encodes one side of a pair and read at the
last real token (`model/reward.py`). An input longer than `max_length` loses the prompt's earliest tokens; a
response that does not fit alone is a missing reward that says so. Both are counted (`take_counts`).

Determinism: a rollout's score must not depend on which rollouts shared its batch, and CPU kernels give a row the
same bits only in batches of the same shape (docs/rewards.md), so every forward's shape follows from the row alone:
`batch_size` rows (unused rows hold one pad token) of a length bucket chosen by the row's own length.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rollout_lib.reward.contract import RewardInput
from rollout_lib.settings_base import ModelRef
from rollout_lib.checkpoint import read_manifest
from rollout_lib.hardware import CPU, place_model
from rollout_lib.store import ObjectStore, StoreError

SMALLEST_BUCKET = 32
COUNTS = ("scored", "prompt_truncated", "prompt_tokens_dropped", "missing_too_long")


class _BatchingScorer:
    """A reward model as an async reward function: the calls waiting are gathered into batches, each input encoded
    as train-rm encodes one side of a pair, and the counts of what inputs lost kept (`take_counts`). Subclasses
    say how a batch of encoded inputs is scored (`_score_encoded`)."""

    def __init__(self, tokenizer, *, max_length: int, batch_size: int, name: str):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.__name__ = name  # how the reward loop names this reward in errors and per-function scores
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")
        self._waiting: list[tuple[RewardInput, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self._counts: Counter = Counter()
        self._counts_lock = threading.Lock()

    async def __call__(self, item: RewardInput) -> float:
        loop = asyncio.get_running_loop()
        if self._drainer is None or self._drainer.done() or self._drainer.get_loop() is not loop:
            # Each step's scoring runs its own event loop: what an earlier one left waiting is dead.
            self._waiting = [(waiting, future) for waiting, future in self._waiting
                             if future.get_loop() is loop and not future.done()]
            self._drainer = loop.create_task(self._drain())
        future = loop.create_future()
        self._waiting.append((item, future))
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # the calls made in this turn of the event loop join the first batch
        while self._waiting:
            taken = [(item, future) for item, future in self._waiting if not future.done()]  # done: timed out
            self._waiting = []
            if not taken:
                continue
            try:
                outcomes = await self._score_items([item for item, _ in taken])
            except Exception as exc:  # noqa: BLE001 - the model failed: every call of the batch reports it
                outcomes = [exc] * len(taken)
            for (_, future), outcome in zip(taken, outcomes):
                if future.done():
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    async def _score_items(self, items: list[RewardInput]) -> list[float | Exception]:
        raise NotImplementedError

    def encode(self, items: Sequence[RewardInput]) -> tuple[list[float | Exception | None], dict[int, list[int]]]:
        """Each item's input ids (by index), or the exception that says why it has none (in `outcomes`); counts
        what the inputs lost."""
        from rollout_lib.model.reward import ResponseTooLongError, encode_for_reward_model

        outcomes: list[float | Exception | None] = [None] * len(items)
        encoded: dict[int, list[int]] = {}
        counts: Counter = Counter()
        for index, item in enumerate(items):
            try:
                model_input = encode_for_reward_model(self.tokenizer, item.prompt, item.completion_text,
                                                      self.max_length)
            except ResponseTooLongError as exc:
                counts["missing_too_long"] += 1
                outcomes[index] = exc
            except Exception as exc:  # noqa: BLE001 - this rollout's reward is missing, not the batch's
                outcomes[index] = exc
            else:
                encoded[index] = model_input.input_ids
                counts["prompt_truncated"] += model_input.prompt_tokens_dropped > 0
                counts["prompt_tokens_dropped"] += model_input.prompt_tokens_dropped
        counts["scored"] += len(encoded)
        with self._counts_lock:
            self._counts.update(counts)
        return outcomes, encoded

    def take_counts(self) -> dict[str, int]:
        """Counts since the last call: rollouts scored, prompts shortened, prompt tokens dropped, responses too
        long to score."""
        with self._counts_lock:
            counts, self._counts = self._counts, Counter()
        return {name: counts[name] for name in COUNTS}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RewardModelScorer(_BatchingScorer):
    """score = the reward model's scalar output for (prompt, completion), computed in this process, in a worker
    thread of its own so the event loop (and every other reward) goes on meanwhile."""

    def __init__(self, model, tokenizer, *, max_length: int, batch_size: int, name: str):
        super().__init__(tokenizer, max_length=max_length, batch_size=batch_size, name=name)
        self.model = model.eval()

    async def _score_items(self, items: list[RewardInput]) -> list[float | Exception]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.score_batch, items)

    def score_batch(self, items: Sequence[RewardInput]) -> list[float | Exception]:
        """One score, or the exception that says why there is none, per item, in order (blocking)."""
        import torch

        from rollout_lib.model.reward import pad_right, reward_scores

        outcomes, encoded = self.encode(items)
        by_bucket: dict[int, list[int]] = {}
        for index, ids in encoded.items():
            by_bucket.setdefault(self.bucket(len(ids)), []).append(index)
        pad = self.tokenizer.pad_token_id
        with torch.inference_mode():
            for length, rows in sorted(by_bucket.items()):
                for start in range(0, len(rows), self.batch_size):
                    chunk = rows[start:start + self.batch_size]
                    sequences = [encoded[index] for index in chunk] + [[pad]] * (self.batch_size - len(chunk))
                    scores = reward_scores(self.model, *pad_right(sequences, pad, length))
                    for index, score in zip(chunk, scores.tolist()):
                        outcomes[index] = score
        return outcomes

    def bucket(self, length: int) -> int:
        """The padded length of every batch a row of `length` tokens runs in."""
        bucket = SMALLEST_BUCKET
        while bucket < length:
            bucket *= 2
        return min(bucket, self.max_length)


class ServedRewardModelScorer(_BatchingScorer):
    """score = the reward model's output as a vLLM pooling server computes it (`POST /classify` on token ids, raw
    score, through the replica pool: a replica that dies mid-step is failed over). The inputs are encoded here, with
    the checkpoint's own tokenizer, exactly as for the in-process scorer; the server only runs the model.

    The server batches requests as they arrive, so a score may differ from the in-process one, and between reruns,
    in the last bits (~1e-7 measured on the tiny RM); `engine` is part of the training identity for that reason."""

    def __init__(self, pool, tokenizer, *, max_length: int, batch_size: int, name: str):
        super().__init__(tokenizer, max_length=max_length, batch_size=batch_size, name=name)
        self.pool = pool

    async def _score_items(self, items: list[RewardInput]) -> list[float | Exception]:
        outcomes, encoded = await asyncio.get_running_loop().run_in_executor(self._executor, self.encode, items)
        indices = list(encoded)
        chunks = [indices[start:start + self.batch_size] for start in range(0, len(indices), self.batch_size)]
        replies = await asyncio.gather(*(self.pool.classify([encoded[index] for index in chunk])
                                         for chunk in chunks), return_exceptions=True)
        for chunk, reply in zip(chunks, replies):
            if isinstance(reply, BaseException) and not isinstance(reply, Exception):
                raise reply
            for position, index in enumerate(chunk):
                outcomes[index] = reply if isinstance(reply, Exception) else reply[position]
        return outcomes


def load_scorer(settings, served_models=None, where: str = "reward_model", hardware=None):
    """The scorer of a reward's settings (reward.settings.RewardModelSettings) at `where` (the locator of its
    `reward_model`). `engine = "embedded"`: model and tokenizer in this process, the model on `hardware`
    (hardware.ResolvedHardware, the run's; default CPU in fp32). `engine = "vllm"`: the model on vLLM's pooling
    runner, served by rollout or, with `base_url`, by you, reached through `served_models` (serving.served.ServedModels,
    the run's); only its tokenizer loaded here. Both send the same requests."""
    from rollout_lib.model.loading import load_tokenizer, resolve_model

    ref = settings.reward_model
    manifest = reward_checkpoint_manifest(ref)
    resolved = resolve_model(ref)
    tokenizer = load_tokenizer(resolved)
    name = f"reward_model({ref.uri})"
    if settings.engine == "vllm":
        if served_models is None:
            raise ValueError(f"{where}: a served reward model needs the run's ServedModels")
        if settings.base_url is not None:  # servers you run: connected and checked, never started
            pool = served_models.reward_model_at(ref, settings.base_url, settings.served_name, tokenizer=tokenizer,
                                                 where=f"{where.removesuffix('.reward_model')}.base_url")
        else:
            pool = served_models.reward_model_pool(ref, replicas=settings.replicas, where=where, gpus=settings.gpus)
        max_length = settings.max_length or (manifest or {}).get("max_seq_len") or pool.max_model_len
        if pool.max_model_len is not None and max_length > pool.max_model_len:
            raise ValueError(f"{where}: max_length {max_length} is more than the server's max_model_len "
                             f"{pool.max_model_len}")
        return ServedRewardModelScorer(pool, tokenizer, max_length=max_length, batch_size=settings.batch_size,
                                       name=name)

    model = place_model(_sequence_classifier(ref, resolved), hardware or CPU)
    max_length = settings.max_length or (manifest or {}).get("max_seq_len") or _max_positions(ref, model, tokenizer)
    return RewardModelScorer(model, tokenizer, max_length=max_length, batch_size=settings.batch_size, name=name)


def reward_checkpoint_manifest(ref: ModelRef) -> dict | None:
    """The manifest of the checkpoint `ref` names (None: it names no checkpoint); a checkpoint that is not a
    reward model (a policy of train-sft or train-rl) is an error: its weights have no score head."""
    from rollout_lib.model.loading import ModelLoadError, checkpoint_named_by

    checkpoint_id = checkpoint_named_by(ref)
    if checkpoint_id is None:
        return None
    try:
        manifest = read_manifest(ObjectStore(ref.store), checkpoint_id)
    except StoreError as exc:
        raise ModelLoadError(f"reward model {ref.uri!r}: {exc}") from None
    if manifest.get("kind_of_model") != "reward_model":
        shown = ref.uri if ref.uri == checkpoint_id else f"{ref.uri} ({checkpoint_id})"
        raise ModelLoadError(f"checkpoint {shown} is a {manifest.get('kind_of_model')!r}, not a reward model "
                             "(train-rm writes those)")
    if manifest.get("reward_head", "bradley_terry") != "bradley_terry":
        shown = ref.uri if ref.uri == checkpoint_id else f"{ref.uri} ({checkpoint_id})"
        raise ModelLoadError(f"checkpoint {shown} is a {manifest['reward_head']} reward model: it compares two "
                             "responses and has no reward for one (train it with head = \"bradley_terry\")")
    return manifest


def check_reward_model(ref: ModelRef) -> None:
    """What plan time can check without loading the model: a checkpoint is a reward model's, a local directory
    holds a sequence classifier. (A hub id is checked when it loads.)"""
    from rollout_lib.model.loading import locate_model

    if reward_checkpoint_manifest(ref) is not None:
        return
    located = locate_model(ref)
    config = Path(located.source) / "config.json"
    if located.is_local and not located.gguf_file and config.is_file():
        architectures = json.loads(config.read_text()).get("architectures") or []
        if architectures and not any(name.endswith("ForSequenceClassification") for name in architectures):
            raise _not_a_classifier(ref, f"its architecture is {', '.join(architectures)}")


def _sequence_classifier(ref: ModelRef, resolved):
    import torch
    from transformers import AutoModelForSequenceClassification

    from rollout_lib.model.loading import FROM_PRETRAINED, ModelLoadError

    try:
        with FROM_PRETRAINED:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                resolved.source, dtype=torch.float32, output_loading_info=True, **resolved.from_pretrained_kwargs())
    except (OSError, ValueError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"cannot load reward model {ref.uri!r} from {resolved.source!r}: {first_line}") from exc
    if info.get("missing_keys"):
        # A causal LM loads as a sequence classifier with a newly initialised (random) head: scores would be noise.
        raise _not_a_classifier(ref, f"its weights lack {', '.join(sorted(info['missing_keys'])[:3])}, so its score "
                                     "head would be random")
    if model.config.num_labels != 1:
        raise _not_a_classifier(ref, f"it has {model.config.num_labels} labels; a reward model has one output")
    return model


def _not_a_classifier(ref: ModelRef, why: str):
    from rollout_lib.model.loading import ModelLoadError

    return ModelLoadError(f"model {ref.uri!r} is not a reward model (a sequence classifier with one output): {why}")


def _max_positions(ref: ModelRef, model, tokenizer) -> int:
    positions = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    if not positions or positions > 1_000_000:  # transformers' "no limit known" is a huge integer
        from rollout_lib.model.loading import ModelLoadError

        raise ModelLoadError(f"reward model {ref.uri!r}: its config gives no maximum length; set max_length")
    return int(positions)
