"""Settings: the seed's TOML shape, dotted-locator errors, overrides, stable hashes, the LR schedule."""

from pathlib import Path

import pytest

from rollout_lib.config import ConfigError, RmConfig
from rollout_lib.plan_checks import load_config, validate_config
from rollout_lib.identity.training import training_hash
from rollout_lib.config.common import OptimizerSettings
from rollout_lib.config.loading import parse_override, read_toml
from rollout_lib.trainer.optim import lr_at

ROOT = Path(__file__).resolve().parent.parent


def rm_raw(**rm_overrides):
    raw = read_toml(ROOT / "configs/rm-tiny.toml")
    raw["algorithm"]["rm"].update(rm_overrides)
    return raw


def error_of(raw) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(RmConfig, raw)
    return str(info.value)


@pytest.mark.parametrize("name", ["rm-tiny.toml", "rm-default.toml"])
def test_shipped_rm_configs_validate(name):
    config = load_config(RmConfig, ROOT / "configs" / name)
    assert config.settings.head == "bradley_terry"
    assert config.settings.budget.max_steps >= 1


def test_lr_must_be_positive_with_locator():
    raw = rm_raw()
    raw["algorithm"]["rm"]["optimizer"]["lr"] = 0
    assert "algorithm.rm.optimizer.lr: must be > 0" in error_of(raw)


def test_minibatch_size_zero_is_rejected_with_locator():
    assert "algorithm.rm.minibatch_size: must be >= 1" in error_of(rm_raw(minibatch_size=0))


def test_typo_is_an_unknown_key_error_naming_the_key():
    raw = rm_raw()
    raw["algorithm"]["rm"]["optimizer"]["learning_rate"] = 1e-3
    assert "algorithm.rm.optimizer.learning_rate: unknown key" in error_of(raw)


def test_unknown_head_lists_the_heads_that_exist():
    message = error_of(rm_raw(head="pointwise"))
    assert "algorithm.rm.head: unknown head 'pointwise'" in message
    assert "bradley_terry" in message and "pairwise_logistic" in message


def test_pairwise_logistic_is_a_head():  # tests/test_rm_heads.py trains it
    assert validate_config(RmConfig, rm_raw(head="pairwise_logistic")).settings.head == "pairwise_logistic"


def test_missing_section_names_its_place():
    raw = rm_raw()
    del raw["algorithm"]["rm"]["budget"]
    assert "algorithm.rm.budget: required key is missing" in error_of(raw)


def test_dataset_accepts_type_or_kind_but_not_both():
    raw = rm_raw()
    raw["algorithm"]["rm"]["dataset"] = {"kind": "jsonl_path", "path": "data/rm-tiny.jsonl"}
    assert validate_config(RmConfig, raw, base_dir=ROOT).settings.dataset.type == "jsonl_path"
    raw["algorithm"]["rm"]["dataset"] = {"kind": "jsonl_path", "type": "jsonl_path", "path": "data/rm-tiny.jsonl"}
    assert "algorithm.rm.dataset: give either `type` or `kind`" in error_of(raw)


def test_overrides_are_typed_like_toml_values():
    assert parse_override("a.b=1e-4") == (["a", "b"], 1e-4)
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=[0.9, 0.95]") == (["a"], [0.9, 0.95])
    assert parse_override("run.store=s3://bucket/x") == (["run", "store"], "s3://bucket/x")


def test_set_overrides_apply_and_unknown_paths_fail(tmp_path):
    config = load_config(RmConfig, ROOT / "configs/rm-tiny.toml",
                         ["algorithm.rm.optimizer.lr=0.5", "algorithm.rm.budget.max_steps=7"])
    assert config.settings.optimizer.lr == 0.5 and config.settings.budget.max_steps == 7
    with pytest.raises(ConfigError, match=r"algorithm\.rm\.budget\.max_stepz: unknown key"):
        load_config(RmConfig, ROOT / "configs/rm-tiny.toml", ["algorithm.rm.budget.max_stepz=7"])


def test_training_hash_is_stable_and_sensitive():
    a = load_config(RmConfig, ROOT / "configs/rm-tiny.toml")
    b = validate_config(RmConfig, dict(reversed(list(read_toml(ROOT / "configs/rm-tiny.toml").items()))))
    assert training_hash(a) == training_hash(b)  # key order in the TOML does not matter
    c = load_config(RmConfig, ROOT / "configs/rm-tiny.toml", ["algorithm.rm.optimizer.lr=0.002"])
    assert training_hash(a) != training_hash(c)


def test_training_hash_ignores_where_the_store_is():
    a = load_config(RmConfig, ROOT / "configs/rm-tiny.toml", ["run.store=/tmp/a"])
    b = load_config(RmConfig, ROOT / "configs/rm-tiny.toml", ["run.store=/tmp/b"])
    assert training_hash(a) == training_hash(b)  # checkpoint ids and cache keys: the same training


def test_relative_local_store_is_made_absolute():
    config = load_config(RmConfig, ROOT / "configs/rm-tiny.toml", ["run.store=.rollout/x"])
    assert Path(config.run.store).is_absolute()
    assert load_config(RmConfig, ROOT / "configs/rm-tiny.toml", ["run.store=memory://x"]).run.store == "memory://x"


def test_lr_schedule_shapes():
    warm = OptimizerSettings(lr=1.0, warmup_steps=4, schedule="constant")
    assert [lr_at(s, warm, 10) for s in (1, 2, 4, 5, 10)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    linear = OptimizerSettings(lr=1.0, warmup_steps=0, schedule="linear")
    assert lr_at(5, linear, 10) == pytest.approx(0.5) and lr_at(10, linear, 10) == pytest.approx(0.0)
    cosine = OptimizerSettings(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(2, cosine, 12) == pytest.approx(1.0)
    assert lr_at(7, cosine, 12) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(12, cosine, 12) == pytest.approx(0.1)


def test_optimizer_kind_and_betas_validated():
    with pytest.raises(ValueError, match="betas"):
        OptimizerSettings(lr=1.0, betas=(0.9, 1.5))
    with pytest.raises(ValueError):
        OptimizerSettings(lr=1.0, kind="adam")
