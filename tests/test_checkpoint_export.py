"""Exporting a checkpoint (and scoring, which exports to a temporary directory) writes only inside the directory
it is given: file names come from the manifest, which is data, and a name that is not a plain file name is refused
before anything is written."""

from __future__ import annotations

import pytest
import torch

from clirun import run_rollout
from rollout_lib.rm.checkpoints import load_reward_checkpoint
from rollout_lib.store import ObjectStore, StoreError
from rollout_lib.checkpoint import CHECKPOINT_KIND, export_hf_directory

BAD_NAMES = ["../escaped.txt", "/tmp/rollout-absolute-escape.txt", "sub/dir.txt", "..", ".", "", "a\\b.txt",
             "config.json", "model.safetensors"]


def checkpoint_with_tokenizer_file(store: ObjectStore, name: str) -> str:
    """A hand-made manifest, as anyone who can write to the store could make one."""
    manifest = {
        "kind": CHECKPOINT_KIND,
        "kind_of_model": "reward_model",
        "step": 0,
        "parent": None,
        "weights": store.put_tensors({"w": torch.zeros(2)}, {"format": "pt"}),
        "optimizer": store.put_tensors({"none": torch.zeros(1)}),
        "model": {"architecture": "BertForSequenceClassification", "config": store.put_json({"model_type": "bert"}),
                  "tokenizer_files": {"tokenizer.json": store.put_bytes(b"{}"), name: store.put_bytes(b"pwned")}},
    }
    return store.put_json(manifest)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_export_refuses_a_file_name_that_is_not_plain_and_writes_nothing(tmp_path, name):
    store = ObjectStore(str(tmp_path / "store"))
    checkpoint = checkpoint_with_tokenizer_file(store, name)
    out = tmp_path / "sandbox" / "out"
    with pytest.raises(StoreError) as caught:
        export_hf_directory(store, checkpoint, out)
    assert str(caught.value).startswith(f"checkpoint {checkpoint}: tokenizer file name {name!r} is not a plain")
    assert not (tmp_path / "sandbox").exists()  # refused before the directory was even made
    assert not (tmp_path / "escaped.txt").exists()


def test_scoring_refuses_it_too(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    checkpoint = checkpoint_with_tokenizer_file(store, "../../../../../../tmp/rollout-score-escape.txt")
    with pytest.raises(StoreError, match=f"checkpoint {checkpoint}: tokenizer file name"):
        load_reward_checkpoint(store, checkpoint)


def test_the_cli_says_so_in_one_line(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    checkpoint = checkpoint_with_tokenizer_file(store, "../escaped.txt")
    done = run_rollout("export", "--checkpoint", checkpoint, "--out", str(tmp_path / "out"),
                       "--store", str(tmp_path / "store"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (f"rollout: error: checkpoint {checkpoint}: tokenizer file name '../escaped.txt' "
                                   "is not a plain file name (no path separators, '..', absolute paths, or "
                                   "['adapter_config.json', 'adapter_model.safetensors', 'config.json', "
                                   "'model.safetensors'])")
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "out").exists()
