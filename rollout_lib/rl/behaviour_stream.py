"""Behaviour logprobs computed while a step samples: the trainer's recompute (rl/behaviour.py) moved off the
advantages stage, onto the rollouts as they come in.

With `max_off_policy_steps` > 0 the trainer recomputes the behaviour logprobs of every policy-sampled row under the
sampling state, in chunks of CHUNK_ROWS rows in row order. Which rows make up each chunk is known before any row is
sampled: the step's rows are its envs' in config order, `prompts * group_size` each (the sampler contract,
sampling/base.py), and an env on the live policy has every row sampled from the sampling state. So a streamed
sample stage hands each rollout here as well (the hand-over StreamedScoring uses), and the moment all rows of a
chunk are in, a worker thread runs that chunk's forward against the sampling state's frozen copy: the inputs
stamping will give (algo/stamping.py `forward_streams`), the same forward (behaviour.chunk_logprobs). The
advantages stage adopts each chunk whose rows and inputs are its own (behaviour.recompute_behaviour_logprobs), so
the training samples, their id and the run's checkpoints are the staged recompute's, bit for bit; the time moves
into the sample stage, which at k > 0 runs beside the step before's training.

A chunk that is not done here is computed at the advantages stage, as before: one with a row whose inputs cannot
be stamped (stamping then fails there, naming it), one whose forward failed (logged), or every chunk of a step
whose sampler hands no rows over.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import pyarrow as pa

from rollout_lib import wire
from rollout_lib.algo.stamping import forward_streams, sampled_mask
from rollout_lib.config.rl import RlConfig
from rollout_lib.rl.behaviour import CHUNK_ROWS, ForwardInputs, chunk_logprobs
from rollout_lib.sampling.base import OnRollout

logger = logging.getLogger(__name__)


def overlaps_behaviour_logprobs(config: RlConfig) -> bool:
    """Whether a streamed step computes its behaviour logprobs while it samples: when the trainer recomputes them
    and the sampling state is a frozen copy that nothing trains (k > 0), unless `overlap_behaviour_logprobs` is
    off."""
    settings = config.settings
    return settings.overlap_behaviour_logprobs and settings.recomputes_behaviour_logprobs \
        and settings.max_off_policy_steps > 0


class BehaviourStream:
    """Told of a step's rollouts as they are sampled (`stream_to`, per env in config order), it runs each chunk's
    forward in a thread of its own as soon as the chunk's rows are all in; `results` waits for them. Leaving the
    `with` block drops the chunks not started and waits for the one running."""

    def __init__(self, config: RlConfig, model, state_id: str, pad_token_id: int = 0):
        self.model, self.state_id, self.pad_token_id = model, state_id, pad_token_id
        self.max_seq_len = config.settings.max_seq_len
        envs = config.settings.envs
        self.temperatures = {env.name: env.sampling.temperature for env in envs}
        self.group_sizes = {env.name: env.sampling.group_size for env in envs}
        self.on_policy = {env.name: env.sampler.frozen is None for env in envs}
        self.unannounced = [env.name for env in envs]  # envs not handed over yet, in the order they sample
        self.next_row = self.next_policy_row = 0  # where the next env's rows start: in the table, among policy rows
        self.policy_rows: int | None = None  # how many rows the recompute forwards, once every env is known
        self.inputs: dict[int, tuple[int, str, ForwardInputs] | None] = {}  # policy row -> (row, id, inputs)
        self.running: dict[int, concurrent.futures.Future] = {}  # chunk index -> its forward
        self.forward_seconds = 0.0
        self.lock = threading.Lock()
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="behaviour-logprobs")

    # -- the sampling thread(s) -----------------------------------------------------------------------------------

    def stream_to(self, env_name: str, prompts: pa.Table) -> OnRollout | None:
        """The callback for an env's rows (by index among them), or None for an env a frozen model samples;
        `prompts`: the env's PROMPTS rows the step drew."""
        with self.lock:
            if not self.unannounced or self.unannounced[0] != env_name:
                raise AssertionError(f"behaviour stream: env {env_name!r} sampled out of config order")
            self.unannounced.pop(0)
            rows = prompts.num_rows * self.group_sizes[env_name]
            first_row, first_policy_row = self.next_row, self.next_policy_row
            self.next_row += rows
            if self.on_policy[env_name]:
                self.next_policy_row += rows
            if not self.unannounced:
                self.policy_rows = self.next_policy_row
                if self.policy_rows:
                    self._start_ready(self.policy_rows - 1)  # a last, short chunk may have waited for its end
        if not self.on_policy[env_name]:
            return None
        temperature = self.temperatures[env_name]

        def on_rollout(index: int, record: dict) -> None:
            self._add(first_policy_row + index, first_row + index, record, temperature)

        return on_rollout

    def _add(self, policy_row: int, row: int, record: dict, temperature: float) -> None:
        try:
            if record["sampled_from"] != self.state_id:
                raise ValueError(f"sampled from {record['sampled_from']!r}, not the state {self.state_id!r}")
            sampled = sampled_mask(record["completion_turns"], len(record["completion_ids"]), record["sample_id"])
            streams = forward_streams(record["prompt_ids"], record["completion_ids"], sampled, self.max_seq_len,
                                      temperature)
            found = (row, record["sample_id"], ForwardInputs.of(*streams))
        except (ValueError, KeyError) as exc:  # left to the advantages stage, which stamps it (and says why not)
            logger.debug("behaviour stream: row %d left to the advantages stage: %s", row, exc)
            found = None
        with self.lock:
            self.inputs[policy_row] = found
            self._start_ready(policy_row)

    def _start_ready(self, policy_row: int) -> None:
        """Start the forward of `policy_row`'s chunk if all its rows are in (the lock held)."""
        index = policy_row // CHUNK_ROWS
        start = index * CHUNK_ROWS
        stop = start + CHUNK_ROWS if self.policy_rows is None else min(start + CHUNK_ROWS, self.policy_rows)
        if index in self.running or stop <= start or any(self.inputs.get(member) is None
                                                          for member in range(start, stop)):
            return
        chunk = [self.inputs[member] for member in range(start, stop)]
        self.running[index] = self.executor.submit(self._forward, chunk)

    # -- the worker thread ----------------------------------------------------------------------------------------

    def _forward(self, chunk: list[tuple[int, str, ForwardInputs]]) -> list[list[float]]:
        started = time.perf_counter()
        values = chunk_logprobs(self.model, [inputs for _, _, inputs in chunk], self.pad_token_id)
        with self.lock:
            self.forward_seconds += time.perf_counter() - started
        return values

    # -- the end of the stage -------------------------------------------------------------------------------------

    def results(self) -> tuple[pa.Table, dict]:
        """Every chunk computed (wire.BEHAVIOUR_LOGPROBS), once the forwards running are done, and metrics:
        `behaviour/precompute_s` the forwards' seconds, `behaviour/precompute_tail_s` the wait for them here."""
        started = time.perf_counter()
        records = []
        for index in sorted(self.running):
            try:
                values = self.running[index].result()
            except Exception as exc:  # noqa: BLE001  (the advantages stage computes it, and fails there if it must)
                logger.warning("behaviour logprobs of chunk %d left to the advantages stage: %s", index, exc)
                continue
            start = index * CHUNK_ROWS
            for member, logprobs in zip(range(start, start + len(values)), values):
                row, sample_id, inputs = self.inputs[member]
                records.append({"chunk": index, "row": row, "sample_id": sample_id,
                                "inputs_digest": inputs.digest(), "logprobs": logprobs})
        metrics = {"behaviour/precompute_s": self.forward_seconds,
                   "behaviour/precompute_tail_s": time.perf_counter() - started}
        return pa.Table.from_pylist(records, schema=wire.BEHAVIOUR_LOGPROBS), metrics

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> BehaviourStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
