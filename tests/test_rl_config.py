"""train-rl settings: the shipped configs, per-env algorithms by type, dotted-locator errors, plan-time checks,
the group_size = 1 warning, and the dry-run plan."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from rollout_lib.plan_checks import plan_warnings
from rollout_lib.identity.training import training_settings
from rollout_lib.algo.grpo import GrpoSettings
from rollout_lib.algo.max_rl import MaxRlSettings
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import load_config, validate_config
from rollout_lib.identity.training import training_hash
from rollout_lib.config.loading import read_toml
from rollout_lib.plan import describe_plan

ROOT = Path(__file__).resolve().parent.parent


def raw_config(**env_overrides) -> dict:
    raw = read_toml(ROOT / "configs/rl-tiny.toml")
    raw["algorithm"]["rl"]["envs"][0].update(env_overrides)
    return raw


def error_of(raw) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(RlConfig, raw)
    return str(info.value)


SHIPPED_ALGORITHMS = {"rl-tiny.toml": "grpo", "rl-smollm2.toml": "grpo", "rl-reward.toml": "reward",
                      "rl-custom.toml": "custom", "rl-opd.toml": "opd", "rl-sft-distill.toml": "sft",
                      "rl-opsd.toml": "opsd", "rl-calculator-echo.toml": "echo", "rl-guess.toml": "grpo",
                      "rl-length.toml": "grpo", "rl-calculator.toml": "grpo", "rl-agent-tiny.toml": "grpo",
                      "rl-agent-program-tiny.toml": "grpo",
                      "rl-openenv-tiny.toml": "grpo", "rl-mix.toml": "grpo",  # rl-mix's second env: opd
                      "rl-verifiers-single.toml": "grpo", "rl-verifiers-tools.toml": "grpo",
                      "rl-smollm2-tools.toml": "grpo"}


def test_every_shipped_rl_config_is_checked():
    assert sorted(path.name for path in (ROOT / "configs").glob("rl-*.toml")) == sorted(SHIPPED_ALGORITHMS)


@pytest.mark.parametrize("name", sorted(SHIPPED_ALGORITHMS))
def test_shipped_rl_configs_validate_without_warnings(name):
    # rl-custom.toml names example_advantages (tests/, on the path under pytest; PYTHONPATH=tests for the CLI).
    # Validation is plan-time only: rl-opd's teacher and rl-sft-distill's source (runs/teacher-tiny/latest, a
    # checkpoint configs/sft-teacher-tiny.toml makes) are neither looked up nor served here.
    if name.startswith("rl-verifiers"):  # they name verifiers environments (examples/, on the path under pytest)
        pytest.importorskip("verifiers", reason="the verifiers extra is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config(RlConfig, ROOT / "configs" / name)
    assert config.settings.envs and config.settings.budget.max_steps >= 1
    assert config.settings.envs[0].algo.type == SHIPPED_ALGORITHMS[name]


def test_algo_defaults_to_grpo_and_is_chosen_per_env_by_type():
    raw = raw_config()
    del raw["algorithm"]["rl"]["envs"][0]["algo"]
    second = {**raw["algorithm"]["rl"]["envs"][0], "name": "other", "algo": {"type": "max_rl"}}
    raw["algorithm"]["rl"]["envs"].append(second)
    config = validate_config(RlConfig, raw)
    assert config.settings.envs[0].algo == GrpoSettings()
    assert isinstance(config.settings.envs[1].algo, MaxRlSettings)
    dumped = config.model_dump(mode="json")["algorithm"]["rl"]["envs"]
    assert dumped[0]["algo"] == {"type": "grpo", "std_normalize": False, "std_eps": 1e-4}
    assert dumped[1]["algo"] == {"type": "max_rl"}


def test_envs_without_an_algo_inherit_the_run_level_one_and_the_spelling_is_not_the_identity():
    """seed 002: `[algorithm.rl.algo]` is the default of every env that names none; folded into the envs, so a
    run that spells it per env is the same training (same dump, same hash)."""
    raw = raw_config()
    del raw["algorithm"]["rl"]["envs"][0]["algo"]
    second = {**raw["algorithm"]["rl"]["envs"][0], "name": "own", "algo": {"type": "grpo"}}
    raw["algorithm"]["rl"]["envs"].append(second)
    raw["algorithm"]["rl"]["algo"] = {"type": "max_rl"}
    config = validate_config(RlConfig, raw)
    assert isinstance(config.settings.envs[0].algo, MaxRlSettings)  # inherited
    assert config.settings.envs[1].algo == GrpoSettings()  # its own wins
    assert "algo" not in config.model_dump(mode="json")["algorithm"]["rl"]
    spelled = raw_config(algo={"type": "max_rl"})
    spelled["algorithm"]["rl"]["envs"].append(second)
    assert training_hash(validate_config(RlConfig, spelled)) == training_hash(config)
    raw["algorithm"]["rl"]["algo"] = {"type": "max_rl", "std_eps": 1.0}  # max_rl has no such knob
    assert "algorithm.rl.envs[0].algo" in error_of(raw)


def test_sft_names_its_teacher_as_the_sampling_source():
    """seed 002's `teacher` alias: sft's teacher folds into sampler.source (fill-or-agree)."""
    teacher = {"model": "runs/teacher-tiny/latest"}
    aliased = validate_config(RlConfig, raw_config(algo={"type": "sft", "teacher": teacher}))
    spelled = validate_config(RlConfig, raw_config(algo={"type": "sft"}, sampler={"source": teacher}))
    assert aliased.settings.envs[0].sampler.frozen.model.uri == "runs/teacher-tiny/latest"
    assert training_hash(aliased) == training_hash(spelled)
    agreeing = raw_config(algo={"type": "sft", "teacher": teacher}, sampler={"source": teacher})
    assert training_hash(validate_config(RlConfig, agreeing)) == training_hash(spelled)
    conflicting = raw_config(algo={"type": "sft", "teacher": teacher}, sampler={"source": {"model": "tiny:qwen2"}})
    [line] = error_of(conflicting).splitlines()
    assert line.startswith("algorithm.rl.envs[0]: ") and "algo.teacher and sampler.source name different models" \
        in line, line


def test_unknown_algorithm_names_the_ones_that_exist():
    assert (
        "algorithm.rl.envs[0].algo: `type` must be one of: custom, echo, grpo, max_rl, opd, opsd, reward, sft") in error_of(
        raw_config(algo={"type": "ppo"}))
    assert ("algorithm.rl.envs[0].source: `type` must be one of: arrow, hf_disk, jsonl_path, parquet, "
            "reasoning_gym") in error_of(
        raw_config(source={"type": "jsonl", "path": "x.jsonl"}))


def test_algorithm_knobs_are_checked_with_locators():
    assert "algorithm.rl.envs[0].algo.std_eps: must be > 0" in error_of(raw_config(algo={"type": "grpo", "std_eps": 0}))
    assert "algorithm.rl.envs[0].algo.std_normalise: unknown key" in error_of(
        raw_config(algo={"type": "grpo", "std_normalise": True}))
    assert "algorithm.rl.envs[0].algo.std_normalize: unknown key" in error_of(
        raw_config(algo={"type": "max_rl", "std_normalize": True}))


def test_sampling_and_source_errors_name_their_place():
    assert "algorithm.rl.envs[0].sampling.top_p: must be <= 1" in error_of(
        raw_config(sampling={"group_size": 8, "top_p": 1.5}))
    assert "algorithm.rl.envs[0].sampling.temperature: must be >= 0" in error_of(
        raw_config(sampling={"temperature": -1}))
    assert "algorithm.rl.envs[0]: sampling.temperature = 0 (greedy) is for evaluation" in error_of(
        raw_config(sampling={"temperature": 0}))
    assert "algorithm.rl.envs[0].source.size: must be >= 1" in error_of(
        raw_config(source={"type": "reasoning_gym", "dataset": "basic_arithmetic", "size": 0}))
    assert "algorithm.rl.envs[0].source.dataset: no reasoning-gym dataset 'basic_arithmetc'" in error_of(
        raw_config(source={"type": "reasoning_gym", "dataset": "basic_arithmetc", "size": 4}))
    assert "algorithm.rl.envs[0].sampling.max_tokens: must be < algorithm.rl.max_seq_len (128)" in error_of(
        raw_config(sampling={"max_tokens": 128}))


def test_reward_functions_are_resolved_at_plan_time():
    message = error_of(raw_config(rewards=[{"function": "target_length", "kwargs": {"targt": 3}},
                                           {"function": "no_such_reward"}]))
    assert "algorithm.rl.envs[0].rewards[0].function: reward function 'target_length': bad kwargs" in message
    assert "algorithm.rl.envs[0].rewards[1].function: unknown built-in reward function 'no_such_reward'" in message
    assert "rewards: List should have at least 1 item" in error_of(raw_config(rewards=[]))


def test_env_names_are_unique():
    raw = raw_config()
    raw["algorithm"]["rl"]["envs"].append(dict(raw["algorithm"]["rl"]["envs"][0]))
    assert "algorithm.rl.envs[1].name: env name 'words' is used more than once" in error_of(raw)


def test_group_relative_advantage_with_group_size_one_warns():
    with pytest.warns(UserWarning, match=r"envs\[0\].sampling.group_size: grpo is group-relative"):
        config = validate_config(RlConfig, raw_config(sampling={"group_size": 1, "max_tokens": 16}))
    assert [loc for loc, _ in plan_warnings(config)] == ["algorithm.rl.envs[0].sampling.group_size"]


def test_hashes_change_with_the_algorithm_but_not_the_store(tmp_path):
    base = validate_config(RlConfig, raw_config())
    moved = validate_config(RlConfig, {**raw_config(), "run": {"name": "rl-tiny", "seed": 1, "store": str(tmp_path)}})
    other = validate_config(RlConfig, raw_config(algo={"type": "max_rl"}))
    assert training_hash(base) == training_hash(moved)
    assert training_hash(base) != training_hash(other)


def test_dry_run_plan_parses_every_prompt_and_loads_no_model():
    plan = describe_plan(load_config(RlConfig, ROOT / "configs/rl-tiny.toml"))
    assert plan["entry_point"] == "train-rl"
    assert plan["envs"][0]["prompts"] == 8 and plan["envs"][0]["rollouts_per_step"] == 32
    assert plan["snapshots_at"] == [5, 10, 15, 20] and plan["warnings"] == []
    assert plan["frozen_models"] == {}


def test_dry_run_resolves_frozen_references_and_names_one_that_resolves_nowhere(tmp_path):
    """A teacher's checkpoint ref that is not in the store fails the plan (as it would the run), naming the
    setting; a resolvable reference shows what it resolves to. No server is contacted."""
    overrides = [f"run.store={tmp_path / 'store'}"]
    with pytest.raises(ConfigError) as raised:
        describe_plan(load_config(RlConfig, ROOT / "configs/rl-opd.toml", overrides))
    assert str(raised.value) == ("algorithm.rl.envs[0].algo.teacher.model: no checkpoint ref "
                                 f"'runs/teacher-tiny/latest' in {tmp_path / 'store'}, and no local directory of "
                                 "that name")
    served = load_config(RlConfig, ROOT / "configs/rl-opd.toml",
                         [*overrides, 'algorithm.rl.envs[0].algo.teacher={ model = "tiny:qwen2" }'])
    plan = describe_plan(served)
    from rollout_lib.model.loading import model_content_digest

    assert plan["frozen_models"] == {"algorithm.rl.envs[0].algo.teacher": model_content_digest("tiny:qwen2")}


# --- distillation settings: plan-time errors, one line naming the place --------------------------------------


def test_sft_needs_a_frozen_sampling_source():
    message = error_of(raw_config(algo={"type": "sft"}))  # sampler.source defaults to "policy"
    [line] = message.splitlines()
    assert line.startswith("algorithm.rl.envs[0].sampler.source: sft distils a frozen model's samples: set "
                           "sampler.source to a frozen model"), line
    # A frozen source is what it takes (validation never reaches the model).
    config = validate_config(RlConfig, raw_config(algo={"type": "sft"},
                                                  sampler={"source": {"model": "runs/teacher-tiny/latest"}}))
    assert config.settings.envs[0].sampler.frozen.model.uri == "runs/teacher-tiny/latest"


def test_opd_needs_a_teacher_given_as_a_frozen_model():
    assert "algorithm.rl.envs[0].algo.teacher: required key is missing" in error_of(raw_config(algo={"type": "opd"}))
    assert "algorithm.rl.envs[0].algo.teacher: a frozen model is" in error_of(
        raw_config(algo={"type": "opd", "teacher": "runs/teacher-tiny/latest"}))
    assert "algorithm.rl.envs[0].algo.teacher.base_url: " in error_of(
        raw_config(algo={"type": "opd", "teacher": {"base_url": "localhost:8000", "name": "t"}}))


@pytest.mark.parametrize(("name", "where"), [("rl-opd.toml", "algorithm.rl.envs[0].algo.teacher.model"),
                                             ("rl-sft-distill.toml", "algorithm.rl.envs[0].sampler.source.model")])
def test_a_teacher_checkpoint_not_trained_yet_fails_in_one_line_naming_the_setting(name, where, tmp_path):
    """The first thing a run does is compute its training identity, which reads the teacher's checkpoint id: a
    store without runs/teacher-tiny/latest (configs/sft-teacher-tiny.toml not run yet) names the setting."""
    from rollout_lib.identity.training import training_identity

    config = load_config(RlConfig, ROOT / "configs" / name, [f"run.store={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError) as raised:
        training_identity(config)
    [line] = str(raised.value).splitlines()
    assert line == (f"{where}: no checkpoint ref 'runs/teacher-tiny/latest' in {tmp_path / 'empty'}, and no local "
                    "directory of that name")


def test_an_env_may_be_multi_turn_and_echo_without_turns_warns():
    config = validate_config(RlConfig, raw_config(interaction={"type": "calculator", "max_turns": 2},
                                                  algo={"type": "echo", "roles": {"tool": {"alpha": 0.2}}}))
    env = config.settings.envs[0]
    assert env.interaction.max_turns == 2 and env.algo.roles["tool"].alpha == 0.2
    with pytest.warns(UserWarning, match=r"envs\[0\].algo: echo trains on tokens the environment writes"):
        validate_config(RlConfig, raw_config(algo={"type": "echo"}))
    assert ("algorithm.rl.envs[0].interaction: `type` must be one of: agent, calculator, custom, guess_number"
            in error_of(raw_config(interaction={"type": "chess"})))
    assert "algorithm.rl.envs[0].interaction.custom_interaction" not in error_of(
        raw_config(interaction={"type": "custom", "import_path": "no_such_module:Env"}))
    assert "interaction class 'no_such_module:Env': cannot find module" in error_of(
        raw_config(interaction={"type": "custom", "import_path": "no_such_module:Env"}))
    assert "algorithm.rl.envs[0].algo.roles.tool.alpha: must be > 0.0 (got 0)" in error_of(
        raw_config(algo={"type": "echo", "roles": {"tool": {"alpha": 0}}}))


def test_a_custom_rl_loss_is_named_by_import_path_checked_at_plan_time_and_keyed_by_its_source(tmp_path,
                                                                                                 monkeypatch):
    def with_loss(loss: dict) -> dict:
        raw = raw_config()
        raw["algorithm"]["rl"]["loss"] = loss
        return raw

    assert error_of(with_loss({"type": "custom"})).startswith("algorithm.rl.loss: ")
    assert 'needs import_path' in error_of(with_loss({"type": "custom"}))
    missing = error_of(with_loss({"type": "custom", "import_path": "no_such_module_here:loss"}))
    assert missing.startswith("algorithm.rl.loss: ") and "cannot find module 'no_such_module_here'" in missing
    assert "for type = \"custom\"" in error_of(with_loss({"import_path": "example_losses:clipped_importance_pg"}))

    default = validate_config(RlConfig, raw_config())
    assert set(training_settings(default)["loss"]) == {"eps_low", "eps_high", "kl_coef", "ref_kl_eps_low",
                                                        "ref_kl_kl_coef"}  # identities from before stay

    module = tmp_path / "my_rl_loss.py"
    module.write_text("def loss(*, logprobs, inference_logprobs, advantages, weights, scale=1.0):\n"
                      "    return -(weights * logprobs * advantages).sum() * scale\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = validate_config(RlConfig, with_loss({"type": "custom", "import_path": "my_rl_loss:loss",
                                                  "kwargs": {"scale": 2.0}}))
    dumped = training_settings(custom)["loss"]
    assert dumped["import_path"] == "my_rl_loss:loss" and dumped["kwargs"] == {"scale": 2.0} and dumped["source"]
    before = training_hash(custom)
    module.write_text(module.read_text().replace("* scale", "* scale * 0.5"))
    assert training_hash(validate_config(RlConfig, with_loss({"type": "custom", "import_path": "my_rl_loss:loss",
                                                              "kwargs": {"scale": 2.0}}))) != before
    # The user's function with its kwargs bound; the default is the registered DPPO+k2 loss.
    assert custom.settings.loss_kwargs()["rl_loss"].keywords == {"scale": 2.0}
    assert default.settings.loss_kwargs()["rl_loss"].type_name == "default"
