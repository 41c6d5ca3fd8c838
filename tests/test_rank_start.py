"""Ranks forked from their launcher (trainer/torchrun.py, issue 39) against fresh interpreters: the way back
(ROLLOUT_RANK_START=fresh) trains the same checkpoint; the launcher refuses to fork beside a thread it does not know;
a bad value of the setting stops torchrun before anything runs, naming it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import psutil
import pytest
from test_data_parallel import sft_config, sft_inputs

from rollout_lib.trainer.causal import CausalLmTrainer
from rollout_lib.trainer.segment_group import SegmentGroup
from rollout_lib.trainer.torchrun import RANK_START_ENV, fork_hazard, unknown_threads


@pytest.mark.slow
def test_forked_and_fresh_ranks_train_the_same_checkpoint(tmp_path, monkeypatch):
    # 2 micro-batches a step, one per rank; one step: the paths differ in how a rank starts, not in what it does
    inputs, batches = sft_inputs(sft_config(str(tmp_path / "store"), 2, 2, 1))
    start = CausalLmTrainer.initial(inputs, batches=batches).checkpoint_id
    ends, commands = {}, {}
    for way in ("fork", "fresh"):
        monkeypatch.setenv(RANK_START_ENV, way)
        group = SegmentGroup(CausalLmTrainer, inputs, {"batches": batches})
        try:
            group.ranks._start("train", "rerun")
            # a forked rank runs torchrun's command line; a fresh one its own module's
            ranks = psutil.Process(group.ranks._process.pid).children()
            commands[way] = {" ".join(rank.cmdline()[1:4]) for rank in ranks}
            ends[way], history = group.train(start, 1, 1)
        finally:
            group.close()
        assert [m["step"] for m in history] == [1]
    assert commands == {"fork": {"-m rollout_lib.trainer.torchrun --standalone"},
                        "fresh": {"-u -m rollout_lib.trainer.segment_worker"}}, commands
    assert ends["fork"] == ends["fresh"] != start, ends


def test_the_launcher_does_not_fork_beside_a_thread_it_does_not_know():
    before = len(unknown_threads())  # pytest's own (xdist's), if any
    release = threading.Event()
    worker = threading.Thread(target=release.wait, daemon=True)
    worker.start()
    try:
        seen, hazard = len(unknown_threads()), fork_hazard()
    finally:
        release.set()
        worker.join()
    assert seen == before + 1
    assert hazard is not None and f"{seen} thread(s) besides the main one run in the launcher" in hazard, hazard


def test_an_unknown_rank_start_stops_torchrun_naming_the_setting():
    done = subprocess.run([sys.executable, "-m", "rollout_lib.trainer.torchrun", "--standalone", "--nproc_per_node=2",
                           "-m", "rollout_lib.trainer.segment_worker", "spec.pkl"],
                          env={**os.environ, RANK_START_ENV: "spawn"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"{RANK_START_ENV}='spawn': expected one of fork, fresh; unset it for fork"
