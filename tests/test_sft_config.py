"""SFT settings: the seed's TOML shape, its validate_plan errors as dotted locators, overrides, and --dry-run."""

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from rollout_cli.main import main
from rollout_lib.config import ConfigError, SftConfig
from rollout_lib.plan_checks import load_config, validate_config
from rollout_lib.config.loading import read_toml

ROOT = Path(__file__).resolve().parent.parent

# The seed's example, verbatim but for the model (no hub here) and the dataset path.
SEED_TOML = """
[algorithm]
kind = "sft"

[algorithm.sft]
minibatch_size = 8
gradient_accumulation = 1
loss_on = { kind = "assistant_only" }

[algorithm.sft.base_model]
uri = "tiny:qwen2"

[algorithm.sft.dataset]
kind = "jsonl_path"
path = "data/sft-tiny.jsonl"

[algorithm.sft.optimizer]
kind = "sgd"
lr = 1.0e-3
weight_decay = 0.0
betas = [0.9, 0.999]
eps = 1.0e-8
warmup_steps = 0
schedule = "constant"

[algorithm.sft.budget]
max_steps = 1000

[algorithm.sft.packing]
kind = "off"
max_seq_len = 2048
"""


def seed_raw() -> dict:
    return tomllib.loads(SEED_TOML)


def error_of(raw) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(SftConfig, raw)
    return str(info.value)


def test_seed_shape_validates_with_vetted_defaults():
    config = validate_config(SftConfig, seed_raw())
    settings = config.settings
    assert settings.base_model.uri == "tiny:qwen2"
    assert settings.loss_on.kind == "assistant_only"
    assert (settings.packing.kind, settings.packing.max_seq_len) == ("off", 2048)
    assert settings.dataset.path == str(Path.cwd() / "data/sft-tiny.jsonl") and settings.optimizer.kind == "sgd"
    assert settings.sequences_per_micro_batch == 8 and not settings.packed

    raw = seed_raw()
    for key in ("gradient_accumulation", "loss_on"):
        del raw["algorithm"]["sft"][key]
    del raw["algorithm"]["sft"]["packing"]
    defaults = validate_config(SftConfig, raw).settings
    assert defaults.gradient_accumulation == 1
    assert (defaults.loss_on.kind, defaults.packing.kind) == ("assistant_only", "off")


@pytest.mark.parametrize("name", ["sft-tiny.toml", "sft-smollm2.toml", "sft-teacher-tiny.toml"])
def test_shipped_sft_configs_validate(name):
    config = load_config(SftConfig, ROOT / "configs" / name)
    assert config.algorithm.kind == "sft" and config.settings.budget.max_steps >= 1


def test_seed_validate_plan_errors_are_dotted_locators():
    raw = seed_raw()
    raw["algorithm"]["sft"]["minibatch_size"] = 0
    assert "algorithm.sft.minibatch_size: must be >= 1" in error_of(raw)
    raw = seed_raw()
    raw["algorithm"]["sft"]["optimizer"]["lr"] = 0
    assert "algorithm.sft.optimizer.lr: must be > 0" in error_of(raw)


def test_gradient_accumulation_must_split_the_minibatch_evenly_and_is_1_when_packing():
    raw = seed_raw()
    raw["algorithm"]["sft"]["gradient_accumulation"] = 3
    assert "algorithm.sft.gradient_accumulation: must divide minibatch_size (8)" in error_of(raw)
    raw["algorithm"]["sft"]["gradient_accumulation"] = 4
    assert validate_config(SftConfig, raw).settings.sequences_per_micro_batch == 2
    raw["algorithm"]["sft"]["packing"]["kind"] = "on"
    assert "algorithm.sft.gradient_accumulation: must be 1 with packing on" in error_of(raw)


def test_unknown_kinds_and_keys_name_their_place():
    raw = seed_raw()
    raw["algorithm"]["sft"]["loss_on"] = {"kind": "completion_only"}
    assert "algorithm.sft.loss_on.kind:" in error_of(raw)
    raw = seed_raw()
    raw["algorithm"]["sft"]["packing"]["kind"] = "greedy"
    assert "algorithm.sft.packing.kind:" in error_of(raw)
    raw = seed_raw()
    raw["algorithm"]["sft"]["packing"]["max_len"] = 512
    assert "algorithm.sft.packing.max_len: unknown key" in error_of(raw)
    raw = seed_raw()
    raw["algorithm"]["kind"] = "rm"
    assert "algorithm.kind:" in error_of(raw)


def test_loss_on_accepts_a_plain_string():
    raw = seed_raw()
    raw["algorithm"]["sft"]["loss_on"] = "all"
    assert validate_config(SftConfig, raw).settings.loss_on.kind == "all"


def test_set_overrides_reach_nested_tables(tmp_path):
    path = tmp_path / "sft.toml"
    path.write_text(SEED_TOML)
    (tmp_path / "data").mkdir()  # a config outside any project: its relative paths resolve from its directory
    shutil.copy(ROOT / "data/sft-tiny.jsonl", tmp_path / "data")
    config = load_config(SftConfig, path, ["algorithm.sft.packing.kind=on", "algorithm.sft.packing.max_seq_len=64",
                                           "algorithm.sft.loss_on.kind=all", "algorithm.sft.optimizer.lr=0.5"])
    assert config.settings.packed and config.settings.packing.max_seq_len == 64
    assert config.settings.loss_on.kind == "all" and config.settings.optimizer.lr == 0.5
    with pytest.raises(ConfigError, match="algorithm.sft.packing.max_seq_len: must be >= 2"):
        load_config(SftConfig, path, ["algorithm.sft.packing.max_seq_len=1"])


def _chat_file(tmp_path) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text(
        '{"prompt": "What is 2+2?", "completion": "4"}\n'
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},'
        ' {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]}\n'
    )
    return path


def test_dry_run_prints_the_plan_and_loads_no_model(tmp_path, capsys, tiny_model_dir):
    code = main(["train", "sft", "--config", "configs/sft-tiny.toml", "--dry-run",
                 "--set", f"algorithm.sft.dataset.path={_chat_file(tmp_path)}",
                 "--set", f"algorithm.sft.base_model.uri={tiny_model_dir}", "--set", "algorithm.sft.budget.max_steps=5",
                 "--set", "algorithm.sft.checkpoint_interval=2"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["entry_point"] == "train-sft"
    assert (plan["train_examples"], plan["assistant_turns"]) == (2, 3)
    assert plan["snapshots_at"] == [2, 4, 5] and plan["loss_on"] == "assistant_only"


def test_dry_run_reports_a_bad_row_as_path_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "user", "content": "no answer"}]}\n')
    code = main(["train", "sft", "--config", "configs/sft-tiny.toml", "--dry-run",
                 "--set", f"algorithm.sft.dataset.path={bad}"])
    assert code == 2
    assert f"rollout: error: {bad}:2: 'messages' has no assistant turn to train on" in capsys.readouterr().err


def test_dry_run_config_error_names_the_key(capsys):
    code = main(["train", "sft", "--config", "configs/sft-tiny.toml", "--dry-run",
                 "--set", "algorithm.sft.minibatch_size=0"])
    assert code == 2
    assert "algorithm.sft.minibatch_size: must be >= 1" in capsys.readouterr().err


def test_shipped_tiny_config_is_the_seed_shape():
    raw = read_toml(ROOT / "configs/sft-tiny.toml")
    assert set(raw["algorithm"]["sft"]) >= {"minibatch_size", "gradient_accumulation", "loss_on", "base_model",
                                            "dataset", "optimizer", "budget", "packing"}


def test_the_shipped_teacher_data_is_what_its_script_makes_from_the_rl_tiny_prompts():
    """data/sft-teacher-tiny.jsonl (configs/sft-teacher-tiny.toml) answers every rl-tiny prompt: regenerate it with
    data/make_sft_teacher.py when the prompts change."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_sft_teacher", ROOT / "data/make_sft_teacher.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.teacher_rows(ROOT / "data/rl-tiny-prompts.jsonl")
    assert (ROOT / "data/sft-teacher-tiny.jsonl").read_text() == "".join(json.dumps(row) + "\n" for row in rows)
    assert len(rows) == 8 and len(script.TEACHER_TEXT.split()) == 12  # target_length(12 words) scores it 1.0
