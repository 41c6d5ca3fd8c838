"""Behaviour of the content-addressed store on a local directory, memory:// and S3 (a local moto server)."""

from __future__ import annotations

import math
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import blake3
import fsspec
import pyarrow as pa
import pytest
import torch

from rollout_lib.identity.claims import claim_run
from rollout_lib.store import (
    CorruptObjectError,
    ObjectNotFoundError,
    ObjectStore,
    StoreError,
    canonical_json,
    content_id,
)
from s3server import BUCKET


@pytest.fixture(params=["local", "memory", "s3"])
def store_args(request, tmp_path):
    """(root, storage_options) of a fresh, empty store on each backend."""
    if request.param == "local":
        return str(tmp_path / "store"), None
    if request.param == "memory":
        return f"memory://store-tests/{uuid.uuid4().hex}", None
    return f"s3://{BUCKET}/{uuid.uuid4().hex}", request.getfixturevalue("s3_options")


@pytest.fixture
def store(store_args):
    return ObjectStore(*store_args)


def overwrite(store: ObjectStore, object_id: str, data: bytes) -> None:
    """Replace an object's stored bytes behind the store's back."""
    fs, path = fsspec.core.url_to_fs(store.object_path(object_id), **store.storage_options)
    fs.pipe_file(path, data)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as uint8, for bit-exact comparison."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


# --- ids and canonical JSON -------------------------------------------------------------------------------------


def test_content_id_is_blake3_hex():
    assert content_id(b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    big = os.urandom(3 << 20)  # takes the multithreaded path
    assert content_id(big) == blake3.blake3(big).hexdigest()


def test_canonical_json():
    assert canonical_json({"b": 1, "a": [1.5, "é", None]}) == '{"a":[1.5,"é",null],"b":1}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"x": math.nan})


# --- behaviour on every backend ----------------------------------------------------------------------------------


def test_bytes_round_trip_and_layout(store):
    object_id = store.put_bytes(b"hello")
    assert object_id == content_id(b"hello")
    assert store.object_path(object_id) == f"{store.root}/objects/{object_id[:2]}/{object_id}"
    assert store.has(object_id)
    assert store.get_bytes(object_id) == b"hello"
    assert store.get_bytes(store.put_bytes(b"")) == b""


def test_put_is_idempotent(store):
    first = store.put_bytes(b"same")
    assert store.put_bytes(b"same") == first
    assert store.get_bytes(first) == b"same"
    fs, path = fsspec.core.url_to_fs(f"{store.root}/objects", **store.storage_options)
    assert len(fs.find(path)) == 1


def test_missing_object(store):
    object_id = content_id(b"never stored")
    assert not store.has(object_id)
    with pytest.raises(ObjectNotFoundError) as err:
        store.get_bytes(object_id)
    assert object_id in str(err.value) and store.root in str(err.value)


@pytest.mark.parametrize("bad", ["", "abc", "A" * 64, "g" * 64, "../" + "a" * 61, None])
def test_invalid_ids_are_rejected(store, bad):
    for call in (store.get_bytes, store.has, store.object_path):
        with pytest.raises(StoreError, match="invalid object id"):
            call(bad)


def test_corrupted_object_is_detected(store):
    good = store.put_bytes(b"keep me")
    victim = store.put_bytes(b"corrupt me")
    overwrite(store, victim, b"corrupt mE")
    with pytest.raises(CorruptObjectError) as err:
        store.get_bytes(victim)
    message = str(err.value)
    assert message == f"object {victim} in {store.root} is corrupted: content hash is {content_id(b'corrupt mE')}"
    assert "\n" not in message
    assert store.get_bytes(good) == b"keep me"  # other objects are unaffected
    # Putting the true content again repairs the stored copy.
    assert store.put_bytes(b"corrupt me") == victim
    assert store.get_bytes(victim) == b"corrupt me"


@pytest.mark.parametrize("damage", ["same size", "truncated", "emptied"])
def test_putting_the_true_content_repairs_a_corrupt_object(store, damage):
    data = os.urandom(4096)
    object_id = store.put_bytes(data)
    broken = {"same size": data[:100] + bytes([data[100] ^ 1]) + data[101:], "truncated": data[:-1],
              "emptied": b""}[damage]
    overwrite(store, object_id, broken)
    with pytest.raises(CorruptObjectError, match=object_id):
        store.get_bytes(object_id)
    assert store.put_bytes(data) == object_id
    assert store.get_bytes(object_id) == data


def test_putting_the_true_tensors_repairs_corrupt_weights(store):
    tensors = {"w": torch.arange(1000, dtype=torch.float32)}
    object_id = store.put_tensors(tensors)
    stored = store.get_bytes(object_id)
    overwrite(store, object_id, stored[:-4] + b"\0\0\0\0")  # same size: only a re-hash can tell
    assert store.put_tensors(tensors) == object_id
    assert torch.equal(store.get_tensors(object_id)["w"], tensors["w"])


def test_a_large_remote_object_of_the_right_size_is_not_downloaded_on_put(s3_options, monkeypatch):
    """The documented limit of repair on remote stores: above 16 MiB only the size is compared."""
    import rollout_lib.store as store_module

    monkeypatch.setattr(store_module, "_REMOTE_REVERIFY_MAX_BYTES", 1024)
    store = ObjectStore(f"s3://{BUCKET}/{uuid.uuid4().hex}", s3_options)
    data = os.urandom(2048)
    object_id = store.put_bytes(data)
    overwrite(store, object_id, data[:-1] + b"!")
    store.put_bytes(data)
    with pytest.raises(CorruptObjectError):  # still loud on read
        store.get_bytes(object_id)
    overwrite(store, object_id, data[:-1])  # a size change is still repaired
    store.put_bytes(data)
    assert store.get_bytes(object_id) == data


def test_local_put_of_an_intact_object_writes_nothing(tmp_path):
    store = ObjectStore(tmp_path)
    object_id = store.put_bytes(b"stay")
    path = store.object_path(object_id)
    inode = os.stat(path).st_ino
    os.utime(path, (1_000_000, 1_000_000))
    store.put_bytes(b"stay")
    assert os.stat(path).st_ino == inode  # not rewritten...
    assert os.stat(path).st_mtime > 1_000_000  # ...but fresh again for gc's grace period


def test_json_round_trip(store):
    obj = {"step": 3, "parent": None, "metrics": {"loss": 0.25}, "name": "ünïcode"}
    object_id = store.put_json(obj)
    assert object_id == content_id(canonical_json(obj))
    assert store.put_json(dict(reversed(list(obj.items())))) == object_id  # key order does not matter
    assert store.get_json(object_id) == obj


def test_table_round_trip_and_stable_id(store):
    schema = pa.schema([pa.field("x", pa.int64(), nullable=False), pa.field("s", pa.list_(pa.string()))])
    table = pa.table({"x": [1, 2, 3], "s": [["a"], None, ["b", "c"]]}, schema=schema)
    object_id = store.put_table(table)
    assert store.put_table(table) == object_id
    # The same rows in different chunks are the same object.
    rechunked = pa.concat_tables([table.slice(0, 1), table.slice(1)])
    assert rechunked.column("x").num_chunks == 2
    assert store.put_table(rechunked) == object_id
    loaded = store.get_table(object_id)
    assert loaded.equals(table) and loaded.schema.equals(schema)
    assert store.get_table(store.put_table(schema.empty_table())).num_rows == 0


def test_get_table_conforms_to_schema(store):
    table = pa.table({"extra": ["z"], "x": pa.array([7], pa.int32())})
    object_id = store.put_table(table)
    wanted = pa.schema([pa.field("x", pa.int64(), nullable=False)])
    conformed = store.get_table(object_id, schema=wanted)
    assert conformed.schema.equals(wanted) and conformed.column("x").to_pylist() == [7]
    with pytest.raises(ValueError, match=object_id):
        store.get_table(object_id, schema=pa.schema([pa.field("missing", pa.int64())]))


def test_tensors_round_trip_bit_exactly(store):
    g = torch.Generator().manual_seed(0)
    bf16 = torch.randn(4, 5, generator=g).to(torch.bfloat16)
    bf16[0, 0] = float("nan")
    bf16[0, 1] = float("-inf")
    tensors = {
        "w.bf16": bf16,
        "w.f32": torch.randn(3, generator=g),
        "i64": torch.tensor([0, -1, 2**62, -(2**63)], dtype=torch.int64),
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
        "flag": torch.tensor([True, False]),
    }
    object_id = store.put_tensors(tensors, metadata={"format": "pt", "step": "7"})
    loaded = store.get_tensors(object_id)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(raw_bytes(loaded[name]), raw_bytes(tensor)), name  # NaN payloads included
    assert store.get_tensors_metadata(object_id) == {"format": "pt", "step": "7"}
    assert store.get_tensors_metadata(store.put_tensors({"a": torch.ones(1)})) == {}
    # Loaded tensors are independent and writable.
    ptrs = [t.untyped_storage().data_ptr() for t in loaded.values() if t.numel()]
    assert len(set(ptrs)) == len(ptrs)
    loaded["w.f32"][0] = 0.0


def test_tensors_that_share_storage_or_are_views(store):
    base = torch.arange(12, dtype=torch.float32)
    tensors = {"base": base, "tied": base, "row": base.view(3, 4)[1], "col": base.view(3, 4)[:, 0]}
    loaded = store.get_tensors(store.put_tensors(tensors))
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name
    loaded["base"][0] = 100.0
    assert loaded["tied"][0] == 0.0  # what comes back shares nothing
    assert base[0] == 0.0  # and the caller's tensors were not touched


def test_refs(store):
    assert store.get_ref("runs/rm-default/latest") is None
    first, second = store.put_bytes(b"one"), store.put_bytes(b"two")
    store.set_ref("runs/rm-default/latest", first)
    assert store.get_ref("runs/rm-default/latest") == first
    store.set_ref("runs/rm-default/latest", second)  # refs are the one mutable thing
    assert store.get_ref("runs/rm-default/latest") == second
    assert store.get_ref("runs/other/latest") is None
    with pytest.raises(ObjectNotFoundError):  # a ref may only point at something already stored
        store.set_ref("runs/x/latest", content_id(b"absent"))
    for bad in ["", "/abs", "runs/../escape", "a//b", "runs/./x", "trailing/", "sp ace", "back\\slash"]:
        with pytest.raises(StoreError, match="invalid ref name"):
            store.set_ref(bad, first)
        with pytest.raises(StoreError, match="invalid ref name"):
            store.get_ref(bad)
    with pytest.raises(StoreError, match="invalid object id"):
        store.set_ref("runs/x/latest", "nope")


def test_a_run_name_belongs_to_the_identity_that_claimed_it(store):
    claim_run(store, "rm-default", "identity-a")
    claim_run(store, "rm-default", "identity-a")  # the same run again (a rerun, an extension): fine
    checkpoint = store.put_bytes(b"checkpoint of a")
    store.set_ref("runs/rm-default/latest", checkpoint)
    with pytest.raises(StoreError) as err:
        claim_run(store, "rm-default", "identity-b")
    assert str(err.value) == (  # a claim without recorded settings (as claims were before they had any)
        f"run name 'rm-default' in {store.root} already holds a run of other settings: training identity "
        "identity-a (stored run) vs identity-b (this run); the stored claim records no settings to compare; rerun "
        "with --name <another name> (a deployment: the override run.name=<another name>)")
    assert store.get_ref("runs/rm-default/latest") == checkpoint  # untouched, and still a checkpoint id
    claim_run(store, "rm-other", "identity-b")  # another name is free
    assert {stored.name for stored in ObjectStore(store.root, store.storage_options).list_refs()} == {
        "refs/runs/rm-default/identity", "refs/runs/rm-default/latest", "refs/runs/rm-other/identity"}
    for bad_name, bad_identity in [("../x", "i"), ("a b", "i"), ("ok", ""), ("ok", None)]:
        with pytest.raises(StoreError):
            claim_run(store, bad_name, bad_identity)


def test_a_refused_claim_names_the_settings_that_differ(store):
    settings = {"algorithm.rm.optimizer.lr": 1e-05, "run.seed": 1, "algorithm.rm.max_seq_len": 64,
                "algorithm.rm.head": "bradley_terry", "algorithm.rm.base_model (files)": "a" * 64}
    claim_run(store, "rm-x", "identity-a", settings)
    claim = store.get_ref("runs/rm-x/identity")
    claim_run(store, "rm-x", "identity-a", dict(reversed(settings.items())))  # the same settings: the same claim
    claim_run(store, "rm-x", "identity-a")  # the same identity without settings (an older caller): fine
    assert store.get_ref("runs/rm-x/identity") == claim
    other = {**settings, "algorithm.rm.optimizer.lr": 0.0001, "run.seed": 2, "algorithm.rm.max_seq_len": 128,
             "algorithm.rm.base_model (files)": "b" * 64}
    del other["algorithm.rm.head"]
    with pytest.raises(StoreError) as err:
        claim_run(store, "rm-x", "identity-b", other)
    assert str(err.value) == (
        f"run name 'rm-x' in {store.root} already holds a run of other settings: "
        f"algorithm.rm.base_model (files): \"{'a' * 36}... (stored run) vs \"{'b' * 36}... (this run), "
        'algorithm.rm.head: "bradley_terry" (stored run) vs unset (this run), '
        "algorithm.rm.max_seq_len: 64 (stored run) vs 128 (this run), and 2 more; "
        "rerun with --name <another name> (a deployment: the override run.name=<another name>)")
    with pytest.raises(StoreError, match=r"other settings: algorithm.rm.optimizer.lr: 1e-05 \(stored run\) vs "
                                         r"0.0001 \(this run\); rerun with --name"):
        claim_run(store, "rm-x", "identity-c", {**settings, "algorithm.rm.optimizer.lr": 0.0001})


def test_local_first_claims_race_to_one_winner(tmp_path):
    store = ObjectStore(tmp_path)

    def claim(i):
        try:
            claim_run(store, "raced", f"identity-{i % 2}")
            return i % 2
        except StoreError:
            return None

    with ThreadPoolExecutor(max_workers=8) as pool:
        winners = {w for w in pool.map(claim, range(32)) if w is not None}
    assert len(winners) == 1


def test_listing(store):
    kept = store.put_bytes(b"listed")
    store.set_ref("runs/a/latest", kept)
    store.set_ref("deep/er/ref", kept)
    objects = store.list_objects()
    assert set(objects) == {kept}
    assert objects[kept].size == len(b"listed") and objects[kept].modified is not None
    assert {stored.name: object_id for stored, object_id in store.list_refs().items()} == {
        "refs/deep/er/ref": kept, "refs/runs/a/latest": kept}
    assert store.list_files("prefect-results") == []


def test_a_second_store_on_the_same_root_sees_everything(store_args):
    writer = ObjectStore(*store_args)
    reader = ObjectStore(writer.root, store_args[1])
    assert reader.root == writer.root
    object_id = writer.put_json({"a": 1})
    writer.set_ref("runs/r/latest", object_id)
    assert reader.has(object_id) and reader.get_json(object_id) == {"a": 1}
    assert reader.get_ref("runs/r/latest") == object_id


def test_concurrent_puts_of_the_same_object(store):
    data = os.urandom(256 * 1024)
    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = list(pool.map(lambda _: store.put_bytes(data), range(16)))
    assert set(ids) == {content_id(data)}
    assert store.get_bytes(ids[0]) == data


def test_tensor_ids_do_not_depend_on_metadata_hash_order(store):
    """safetensors writes metadata in hash-map order, which changes from call to call; ids must not."""
    from safetensors.torch import save

    tensors = {"b": torch.arange(6), "a": torch.ones(3, dtype=torch.bfloat16)}
    metadata = {k: str(i) for i, k in enumerate("zyxwvutsrq")}
    assert len({save(tensors, metadata=metadata) for _ in range(10)}) > 1  # the hazard is real
    ids = {store.put_tensors(tensors, metadata=dict(reversed(metadata.items()))) for _ in range(10)}
    assert len(ids) == 1
    object_id = ids.pop()
    assert int.from_bytes(store.get_bytes(object_id)[:8], "little") % 8 == 0  # data stays 8-byte aligned
    assert store.get_tensors_metadata(object_id) == metadata
    assert torch.equal(store.get_tensors(object_id)["b"], tensors["b"])


# --- local specifics ---------------------------------------------------------------------------------------------


def test_local_root_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = ObjectStore("relative/store")
    assert store.root == str(tmp_path / "relative" / "store")
    object_id = store.put_bytes(b"x")
    assert os.path.isfile(tmp_path / "relative" / "store" / "objects" / object_id[:2] / object_id)
    assert ObjectStore(f"file://{store.root}").get_bytes(object_id) == b"x"


def test_local_corruption_on_disk(tmp_path):
    store = ObjectStore(tmp_path)
    object_id = store.put_bytes(b"0123456789")
    path = store.object_path(object_id)
    with open(path, "r+b") as f:  # flip one byte in place
        f.seek(3)
        f.write(b"X")
    with pytest.raises(CorruptObjectError, match=object_id):
        store.get_bytes(object_id)


def test_local_renames_are_followed_by_a_directory_fsync(tmp_path, monkeypatch):
    """After each rename into objects/ or refs/, the directory holding the new name is fsynced (a crash could
    otherwise lose the name, hence the object or ref); so is the parent of each new directory."""
    synced: list[tuple[str, bool]] = []  # (directory, whether the new file was already in it)
    expected_file: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            synced.append((path, bool(expected_file) and os.path.exists(expected_file[0])))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store = ObjectStore(tmp_path / "store")
    expected_file.append(store.object_path(content_id(b"durable")))
    object_id = store.put_bytes(b"durable")
    shard = os.path.dirname(store.object_path(object_id))
    assert (shard, True) in synced  # the rename, after it happened
    assert (os.path.dirname(shard), False) in synced  # the new shard directory, before the rename
    synced.clear()
    expected_file[0] = str(tmp_path / "store" / "refs" / "runs" / "r" / "latest")
    store.set_ref("runs/r/latest", object_id)
    assert (str(tmp_path / "store" / "refs" / "runs" / "r"), True) in synced
    synced.clear()
    tensors = {"w": torch.ones(3)}
    weights_id = ObjectStore(f"memory://fsync-probe/{uuid.uuid4().hex}").put_tensors(tensors)
    expected_file[0] = store.object_path(weights_id)
    assert store.put_tensors(tensors) == weights_id  # local tensors take their own path: safetensors' save_file
    assert (os.path.dirname(store.object_path(weights_id)), True) in synced


def test_local_writes_leave_no_temporaries(tmp_path):
    store = ObjectStore(tmp_path)
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda i: store.put_bytes(b"%d" % (i % 3)), range(12)))
    store.set_ref("runs/r/latest", content_id(b"0"))
    assert os.listdir(tmp_path / "tmp") == []

def test_a_header_rewritten_to_sorted_order_equals_one_safetensors_wrote_sorted(store):
    """Already-sorted headers are stored as safetensors wrote them (no copy); unsorted ones are rewritten. Both
    paths must give the same bytes, or ids would depend on the hash order after all."""
    from safetensors.torch import save

    tensors = {"w": torch.arange(4, dtype=torch.float32)}
    metadata = {"a": "1", "b": "2"}
    outputs = {save(tensors, metadata=metadata) for _ in range(50)}
    sorted_raw = [data for data in outputs if data.index(b'"a"') < data.index(b'"b"')]
    unsorted_raw = [data for data in outputs if data.index(b'"a"') > data.index(b'"b"')]
    assert sorted_raw and unsorted_raw  # 50 tries see both orders
    assert {store.put_tensors(tensors, metadata=metadata) for _ in range(20)} == {content_id(sorted_raw[0])}


@pytest.mark.parametrize("root", ["local", "memory"])
def test_tensors_streamed_one_at_a_time_are_the_same_object_as_put_all_at_once_and_read_back_alike(tmp_path, root):
    """put_tensors_streamed (sharded snapshots, trainer/sharding.py) writes safetensors' own bytes: its layout order
    (dtype first, then name) and header, whatever dtypes and metadata."""
    from rollout_lib.store_tensors import safetensors_order

    store = ObjectStore(str(tmp_path) if root == "local" else f"memory://streamed-{tmp_path.name}")
    tensors = {"w": torch.randn(3, 4), "b64": torch.randn(2, dtype=torch.float64), "bf": torch.randn(5).bfloat16(),
               "step": torch.tensor(3.0), "i": torch.tensor([7, 8]), "mask": torch.tensor([True, False]),
               "h": torch.randn(2).half(), "u": torch.zeros(3, dtype=torch.uint8), "a.0": torch.randn(1)}
    shapes = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    order = safetensors_order(shapes)
    assert order[:2] == ["i", "b64"] and order[-1] == "mask"  # 64-bit first, BOOL last, names within a dtype
    for metadata in ({"format": "pt", "param_groups": "[]"}, None):
        streamed = store.put_tensors_streamed(shapes, ((name, tensors[name]) for name in order), metadata)
        assert streamed == store.put_tensors(tensors, metadata)
    with pytest.raises(ValueError, match="is not the next of the layout"):
        store.put_tensors_streamed(shapes, ((name, tensors[name]) for name in reversed(order)))
    with pytest.raises(ValueError, match="ended before the layout did"):
        store.put_tensors_streamed(shapes, ((name, tensors[name]) for name in order[:-1]))

    # read back one tensor at a time (a sharded trainer's optimizer state): the same tensors, the hash checked
    object_id = store.put_tensors({**tensors, "empty": torch.empty(0, 4)}, {"format": "pt"})
    read = store.get_tensors_streamed(object_id)
    assert read.metadata == {"format": "pt"} and list(read.layout)[:2] == ["i", "b64"]
    got = dict(read.tensors())
    assert got.keys() == {*tensors, "empty"} and all(torch.equal(got[name], t) for name, t in tensors.items())
    if root == "local":  # a flipped byte is found once the last tensor has been read
        path = next(p for p in tmp_path.rglob(object_id + "*") if p.is_file())
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptObjectError, match="do not hash to its id"):
            list(store.get_tensors_streamed(object_id).tensors())
