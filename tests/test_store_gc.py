"""`rollout gc`: what no ref reaches goes, with the cached task results naming it; what a ref or a running flow
needs stays. On a local directory, memory:// and S3 (moto), then end to end: a gc'd store resumes as a rerun."""

from __future__ import annotations

import json
import os
import time
import uuid

import fsspec
import pyarrow as pa
import pytest
import torch

from clirun import final_result, run_rollout, task_run_states
from rollout_cli.main import main as rollout_main
from rollout_lib.identity.claims import claim_run
from rollout_lib.rl.policy import STEP_STATE_KIND
from rollout_lib.store import ObjectNotFoundError, ObjectStore, StoreError
from rollout_lib.store_gc import _looks_like_json, collect_garbage, plan_gc
from rollout_lib.checkpoint import save_checkpoint
from s3server import BUCKET

HOUR = 3600.0


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return ObjectStore(str(tmp_path / "store"))
    if request.param == "memory":
        return ObjectStore(f"memory://gc-tests/{uuid.uuid4().hex}")
    return ObjectStore(f"s3://{BUCKET}/{uuid.uuid4().hex}", request.getfixturevalue("s3_options"))


def checkpoint(store: ObjectStore, step: int, parent: str | None, model_files: dict, data: dict) -> str:
    """A real checkpoint manifest (save_checkpoint) of a one-layer model after `step` SGD steps."""
    torch.manual_seed(step)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(step):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    return save_checkpoint(store, model=model, optimizer=optimizer, model_files=model_files, step=step,
                           parent=parent, identity="0" * 64, extra={"data": {**data, "cursor": step}})


def write_task_result(store: ObjectStore, key: str, result: dict) -> str:
    """A cache entry as Prefect 3 writes one with the JSON serializer: the result is a JSON string inside."""
    record = {"metadata": {"storage_key": key, "expiration": None, "serializer": {"type": "json"},
                           "prefect_version": "3.8.8", "storage_block_id": None},
              "result": json.dumps(result)}
    fs, path = fsspec.core.url_to_fs(f"{store.root}/prefect-results/{key}", **store.storage_options)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, json.dumps(record).encode())
    return f"prefect-results/{key}"


def table(values: list[int]) -> pa.Table:
    return pa.table({"x": values})


class Run:
    """A store holding one finished run, an RL-style step record, an abandoned run and cache entries."""

    def __init__(self, store: ObjectStore):
        self.store = store
        model_files = {"architecture": "Linear", "config": store.put_json({"hidden": 3}),
                       "tokenizer_files": {"tokenizer.json": store.put_bytes(b'{\n  "model": {"vocab": {}}\n}'),
                                           "vocab.txt": store.put_bytes(b"[PAD]\n[UNK]\n")}}
        self.tokenized, self.plan = store.put_table(table([1, 2, 3])), store.put_table(table([0, 1]))
        data = {"tokenized": self.tokenized, "plan": self.plan}
        self.step0 = checkpoint(store, 0, None, model_files, data)
        self.step1 = checkpoint(store, 1, self.step0, model_files, data)
        self.micro_batches = store.put_table(table([7, 7]))
        self.pending = store.put_json({"kind": STEP_STATE_KIND, "step": 2, "micro_batches": self.micro_batches,
                                       "parent": self.step1, "training_identity": "0" * 64})
        self.latest = checkpoint(store, 3, self.pending, model_files, data)
        store.set_ref("runs/a/latest", self.latest)
        claim_run(store, "a", "identity-a")
        self.pairs = store.put_table(table([9, 9, 9]))  # a task output no manifest names

        # An abandoned run: it shares the model files (kept through run a) but no ref reaches it.
        self.abandoned_tokenized = store.put_table(table([4, 5]))
        self.abandoned = checkpoint(store, 5, None, model_files, {"tokenized": self.abandoned_tokenized})
        manifest = store.get_json(self.abandoned)
        self.abandoned_tensors = {manifest["weights"], manifest["optimizer"]}
        # The chain index (trainer/segment.chain_ref) is a cache: it keeps nothing, and goes with its checkpoint.
        store.set_ref("chains/a-data/step-000000001", self.step1)
        store.set_ref("chains/abandoned-data/step-000000005", self.abandoned)

        self.pairs_entry = write_task_result(store, "a1" * 32, {"pairs": self.pairs, "rows": 3})
        self.tokenized_entry = write_task_result(store, "b2" * 32, {"tokenized": self.tokenized})
        self.abandoned_entry = write_task_result(store, "c3" * 32, {"checkpoint": self.abandoned, "metrics": []})
        self.metrics_entry = write_task_result(store, "d4" * 32, {"accuracy": 0.5})

    @property
    def garbage(self) -> set[str]:
        return {self.pairs, self.abandoned, self.abandoned_tokenized, *self.abandoned_tensors}


def test_gc_deletes_what_no_ref_reaches_and_the_cache_entries_naming_it(store):
    run = Run(store)
    everything = set(store.list_objects())
    later = time.time() + 48 * HOUR  # every file is older than the grace period

    plan = plan_gc(store, grace_seconds=24 * HOUR, now=later)
    assert {stored.name.rsplit("/", 1)[-1] for stored in plan.objects} == run.garbage
    assert {stored.name for stored in plan.results} == {run.pairs_entry, run.abandoned_entry}
    assert [stored.name for stored in plan.index_refs] == ["refs/chains/abandoned-data/step-000000005"]
    assert plan.files[:3] == plan.results + plan.index_refs  # entries go before the objects they name
    assert plan.bytes == sum(stored.size for stored in plan.files) > 0
    assert (plan.kept_objects, plan.kept_for_grace, plan.refs) == (len(everything - run.garbage), 0, 2)
    assert set(store.list_objects()) == everything  # planning deletes nothing

    collect_garbage(store, plan)
    assert set(store.list_objects()) == everything - run.garbage
    for object_id in run.garbage:
        with pytest.raises(ObjectNotFoundError):
            store.get_bytes(object_id)
    for object_id in everything - run.garbage:
        store.get_bytes(object_id)  # every kept object is whole
    assert {stored.name for stored in store.list_files("prefect-results")} == {run.tokenized_entry,
                                                                                run.metrics_entry}
    assert store.get_ref("runs/a/latest") == run.latest
    assert store.get_ref("chains/a-data/step-000000001") == run.step1
    assert store.get_ref("chains/abandoned-data/step-000000005") is None
    assert plan_gc(store, grace_seconds=24 * HOUR, now=later).files == []  # a second pass finds nothing


def test_gc_keeps_everything_written_within_the_grace_period(store):
    run = Run(store)
    plan = plan_gc(store, grace_seconds=HOUR)  # a running flow writes its objects before any ref reaches them
    assert plan.files == []
    assert plan.kept_for_grace == len(run.garbage)


def test_an_old_object_named_by_a_new_cache_entry_is_kept(tmp_path):
    """A task that just finished may return an object stored long ago (content addressing: it already existed), and
    a segment may index a checkpoint stored long ago."""
    store = ObjectStore(str(tmp_path / "store"))
    old, named_by_new, named_by_old, indexed_now = (store.put_bytes(b"old %d" % i) for i in range(4))
    new_entry = write_task_result(store, "e5" * 32, {"table": named_by_new})
    old_entry = write_task_result(store, "f6" * 32, {"table": named_by_old})
    store.set_ref("chains/c/step-000000001", indexed_now)
    long_ago = time.time() - 48 * HOUR
    for object_id in (old, named_by_new, named_by_old, indexed_now):
        os.utime(store.object_path(object_id), (long_ago, long_ago))
    os.utime(f"{store.root}/{old_entry}", (long_ago, long_ago))
    (tmp_path / "store" / "tmp").mkdir(exist_ok=True)
    for name, mtime in (("stale", long_ago), ("being-written", time.time())):
        (tmp_path / "store" / "tmp" / name).write_bytes(b"partial")
        os.utime(tmp_path / "store" / "tmp" / name, (mtime, mtime))

    plan = plan_gc(store, grace_seconds=24 * HOUR)
    assert {stored.name.rsplit("/", 1)[-1] for stored in plan.objects} == {old, named_by_old}
    assert [stored.name for stored in plan.results] == [old_entry]
    assert [stored.name for stored in plan.staging] == ["tmp/stale"]
    assert plan.kept_for_grace == 2 and plan.index_refs == []
    assert new_entry not in {stored.name for stored in plan.files}


def test_a_put_refreshes_an_old_object_for_the_grace_period(tmp_path):
    """A running flow that re-puts an object stored long ago (same content, same id) protects it."""
    store = ObjectStore(str(tmp_path / "store"))
    object_id = store.put_bytes(b"recomputed")
    long_ago = time.time() - 48 * HOUR
    os.utime(store.object_path(object_id), (long_ago, long_ago))
    assert [stored.name for stored in plan_gc(store).objects] == [f"objects/{object_id[:2]}/{object_id}"]
    store.put_bytes(b"recomputed")
    assert plan_gc(store).objects == []


def test_refusals(tmp_path):
    with pytest.raises(StoreError, match="no store at"):
        plan_gc(ObjectStore(str(tmp_path / "nothing-here")))
    store = ObjectStore(str(tmp_path / "store"))
    store.put_bytes(b"x")
    (tmp_path / "store" / "refs" / "runs" / "r").mkdir(parents=True)
    (tmp_path / "store" / "refs" / "runs" / "r" / "latest").write_text("not an id\n")
    with pytest.raises(StoreError, match="'runs/r/latest'.*not an object id"):  # gc never guesses what a ref keeps
        plan_gc(store)


def test_only_json_objects_are_read_whole():
    from safetensors.torch import save

    assert _looks_like_json(b'{"a":1}') and _looks_like_json(b'[\n  "x"') and _looks_like_json(b'  {"k": ')
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table([1]).schema) as writer:
        writer.write_table(table([1]))
    for binary in (sink.getvalue().to_pybytes(), save({"w": torch.ones(2)}), b""):
        assert not _looks_like_json(binary[:16])
    # A safetensors header of 123 + 256k bytes starts with "{": the zero bytes after it still give it away.
    assert not _looks_like_json((123 + 256).to_bytes(8, "little") + b'{"w":{')


def test_gc_command(tmp_path, capsys):
    store = ObjectStore(str(tmp_path / "store"))
    kept, garbage = store.put_bytes(b"kept"), store.put_bytes(b"garbage")
    store.set_ref("runs/r/latest", kept)

    assert rollout_main(["gc", "--store", store.root, "--dry-run", "--grace-hours", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"would delete objects/{garbage[:2]}/{garbage} (7 bytes)",
                   ("would delete 1 objects, 0 cached task results, 0 chain index entries, 0 staging files: "
                    "7 bytes (7 B); kept 1 objects (1 reached from 1 refs, 0 more written in the last 0 h)")]
    assert store.has(garbage)

    assert rollout_main(["gc", "--store", store.root]) == 0  # the default grace period keeps what was just written
    assert "deleted 0 objects" in capsys.readouterr().out and store.has(garbage)
    assert rollout_main(["gc", "--store", store.root, "--grace-hours", "0"]) == 0
    assert capsys.readouterr().out.startswith("deleted 1 objects, 0 cached task results, 0 chain index entries")
    assert not store.has(garbage) and store.has(kept)

    assert rollout_main(["gc", "--store", str(tmp_path / "typo")]) == 2
    assert capsys.readouterr().err == f"rollout: error: no store at {tmp_path / 'typo'}\n"


@pytest.mark.slow
def test_a_collected_store_resumes_as_a_rerun(prefect_server, tmp_path):
    """train-rm, `rollout gc`, train-rm again: the same checkpoint; what gc deleted is recomputed (its cache entry
    went with it), everything else comes back Cached."""
    store = tmp_path / "store"
    args = ["train", "rm", "--config", "configs/rm-tiny.toml", "--set", f"run.store={store}"]
    first = run_rollout(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    expected = final_result(first)["checkpoint"]

    collected = run_rollout("gc", "--store", str(store), "--grace-hours", "0")
    assert collected.returncode == 0, collected.stderr[-3000:]
    assert collected.stdout.startswith("deleted 1 objects, 1 cached task results, 0 chain index"), collected.stdout

    rerun = run_rollout(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    result = final_result(rerun)
    assert result["checkpoint"] == expected
    states = task_run_states(result["flow_run_id"])
    assert states.pop("load-pairs-train") == "Completed"  # its table (the raw pairs) was no checkpoint's data
    assert set(states.values()) == {"Cached"}, states
