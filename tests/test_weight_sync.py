"""The policy server's weights file (serving/weight_sync.py): in shared memory, rewritten in place while the
layout holds, readable by safetensors as any other file, tied output heads included."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rollout_lib.serving import engine
from rollout_lib.serving.weight_sync import SharedWeightsFile


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's lm_head


def test_the_file_is_rewritten_in_place_and_reads_back_bit_for_bit():
    model = Tied()
    weights = SharedWeightsFile(engine.weights_dirs("test-weights-file"))
    try:
        assert str(weights.directory).startswith("/dev/shm/")  # memory, not the disk, on this machine
        assert weights.write(model) == "new file"
        inode = weights.path.stat().st_ino
        for scale in (1.5, -0.25):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(scale)
            assert weights.write(model) == "in place"
            assert weights.path.stat().st_ino == inode  # the same file, not a new one
            written = load_file(weights.path)
            assert written.keys() == model.state_dict().keys()  # the tied head is written as its own entry
            for name, tensor in model.state_dict().items():
                assert torch.equal(written[name], tensor), name

        # Another layout (a dtype changed): a fresh file, then in place again.
        model.body.to(torch.bfloat16)
        assert weights.write(model) == "new file"
        assert load_file(weights.path)["body.weight"].dtype == torch.bfloat16
        assert weights.write(model) == "in place"
    finally:
        weights.remove()
    assert not weights.directory.exists()


def test_a_new_file_goes_where_there_is_room(tmp_path, monkeypatch):
    """A container's /dev/shm is often 64 MB, and a write through a map into a full tmpfs is a SIGBUS, not an
    error: the file goes to the first candidate directory with room, and says so when none has any."""
    import shutil

    model = Tied()
    small, roomy = tmp_path / "small", tmp_path / "roomy"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1024) if "small" in str(path)
                        else real(path))
    weights = SharedWeightsFile((small, roomy))
    assert weights.write(model) == "new file" and weights.directory == roomy
    assert load_file(weights.path).keys() == model.state_dict().keys()
    weights.remove()
    assert not small.exists() and not roomy.exists()

    nowhere = SharedWeightsFile((small,))
    with pytest.raises(OSError, match="no room for the policy's .* MB weights file"):
        nowhere.write(model)
