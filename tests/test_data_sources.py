"""Datasets from the ecosystem (rollout_lib/data/sources.py): parquet, Arrow and save_to_disk tables read as the
equivalent JSONL is, their content (never their path) in keys and identities, and each bad input in one line,
exit 2, at --dry-run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_cli.main import main
from rollout_lib.config import RlConfig, SftConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.identity.training import training_hash
from rollout_lib.data import (DataError, load_examples, load_jsonl_prompts, load_pairs, read_examples, read_pairs)
from rollout_lib.data.prompts import table_prompts
from rollout_lib.identity.digests import content_digest
from rollout_lib.data.tool_messages import template_messages
from rollout_lib.sft.tokenize import sft_tokenizer, tokenize_examples
from rollout_lib.model.loading import resolve_model
from rollout_lib.settings_base import ModelRef
from rollout_lib.identity.data_keys import dataset_identity

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    # The digest cache and the `datasets` cache in the test's own directory, never ~/.cache.
    monkeypatch.setenv("ROLLOUT_CACHE_DIR", str(tmp_path / "cache"))


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def _table(rows: list[dict], rename: dict[str, str] | None = None) -> pa.Table:
    """Rows as a table with every key any row has (a row without one holds null), renamed by `rename`."""
    keys = sorted({key for row in rows for key in row})
    return pa.table({(rename or {}).get(key, key): [row.get(key) for row in rows] for key in keys})


def _write(table: pa.Table, kind: str, where: Path) -> Path:
    """`table` saved as `kind`: a parquet file, an Arrow stream file (as `datasets` writes), a save_to_disk folder."""
    if kind == "parquet":
        path = where / "data.parquet"
        pq.write_table(table, path)
    elif kind == "arrow":
        path = where / "data.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        from datasets import Dataset, DatasetDict

        path = where / "saved"
        DatasetDict({"train": Dataset(table)}).save_to_disk(str(path))
    return path


def _source(kind: str, path: Path, columns: dict | None = None, split: str | None = None):
    return SimpleNamespace(type=kind, path=str(path), split=split, columns=columns or {})


KINDS = ("parquet", "arrow", "hf_disk")


# --- the same rows as the JSONL ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_sft_table_with_trl_names_reads_the_jsonl_rows(tmp_path, kind, tiny_model_dir):
    path = _write(_table(_rows("sft-tiny.jsonl")), kind, tmp_path)
    from_table = read_examples(_source(kind, path), "algorithm.sft.dataset")
    from_jsonl = load_examples(DATA / "sft-tiny.jsonl")
    assert from_table.equals(from_jsonl)
    tokenizer = sft_tokenizer(resolve_model(ModelRef(uri=str(tiny_model_dir))))
    tokenized = [tokenize_examples(table, tokenizer, loss_on="assistant_only", max_seq_len=256, source="x").samples
                 for table in (from_table, from_jsonl)]
    assert tokenized[0].equals(tokenized[1])


def test_sft_table_with_mapped_names_and_trl_conversational_rows(tmp_path):
    rows = [row for row in _rows("sft-tiny.jsonl") if "prompt" in row]
    path = _write(_table(rows, {"prompt": "question", "completion": "reply"}), "parquet", tmp_path)
    mapped = read_examples(_source("parquet", path, {"prompt": "question", "completion": "reply"}), "d")
    assert mapped["messages"].to_pylist() == load_examples(DATA / "sft-tiny.jsonl")["messages"].to_pylist()[:2]
    # TRL's conversational prompt-completion: two message lists that make one conversation.
    conversational = pa.table({"prompt": [[{"role": "user", "content": "2+2?"}]],
                               "completion": [[{"role": "assistant", "content": "4"}]]})
    pq.write_table(conversational, tmp_path / "conv.parquet")
    read = read_examples(_source("parquet", tmp_path / "conv.parquet"), "d")
    assert [template_messages(m) for m in read["messages"].to_pylist()] == [[{"role": "user", "content": "2+2?"},
                                                                            {"role": "assistant", "content": "4"}]]


@pytest.mark.parametrize("kind", KINDS)
def test_rm_table_reads_the_jsonl_pairs(tmp_path, kind):
    path = _write(_table(_rows("rm-tiny.jsonl"), {"prompt": "q"}), kind, tmp_path)
    pairs = read_pairs(_source(kind, path, {"prompt": "q"}), "algorithm.rm.dataset")
    assert pairs.equals(load_pairs(DATA / "rm-tiny.jsonl"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("system_prompt", [None, "Answer with a number."])
@pytest.mark.parametrize("name", ["rl-calculator-prompts.jsonl", "rl-tiny-prompts.jsonl", "rl-opsd-prompts.jsonl"])
def test_rl_table_reads_the_jsonl_prompts(tmp_path, kind, system_prompt, name):
    """Text prompts with answers; a mixed table (some rows `prompt`, some `messages`, as rl-tiny's); info structs."""
    path = _write(_table(_rows(name), {"prompt": "question"}), kind, tmp_path)
    from_table = table_prompts(_source(kind, path, {"prompt": "question"}), "calc", system_prompt, "w")
    assert from_table.equals(load_jsonl_prompts(DATA / name, "calc", system_prompt))


def test_rl_table_in_verls_shape(tmp_path):
    """verl's RL parquet: `prompt` a message list, the answer inside `reward_model`, other columns ignored."""
    table = pa.table({
        "data_source": ["gsm8k", "gsm8k"],
        "prompt": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
                   [{"role": "user", "content": "2+3?"}]],
        "reward_model": [{"style": "rule", "ground_truth": "2"}, {"style": "rule", "ground_truth": "5"}],
        "extra_info": [{"index": 0}, {"index": 1}],
    })
    pq.write_table(table, tmp_path / "train.parquet")
    source = _source("parquet", tmp_path / "train.parquet",
                     {"answer": "reward_model.ground_truth", "info": "extra_info"})
    prompts = table_prompts(source, "math", None, "w")
    expected = [(tmp_path / "p.jsonl").write_text(
        '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}], '
        '"answer": "2", "info": {"index": 0}}\n{"messages": [{"role": "user", "content": "2+3?"}], "answer": "5", '
        '"info": {"index": 1}}\n')]
    assert expected and prompts.equals(load_jsonl_prompts(tmp_path / "p.jsonl", "math"))


def test_rl_table_ids_numbers_and_conversations_checked_as_jsonl_rows(tmp_path):
    pq.write_table(pa.table({"prompt": ["a", "b"], "id": ["x", "x"]}), tmp_path / "dup.parquet")
    with pytest.raises(DataError, match=r"column 'id': id 'x' repeats \(rows 0 and 1\)"):
        table_prompts(_source("parquet", tmp_path / "dup.parquet"), "e", None, "w")
    pq.write_table(pa.table({"prompt": ["a", "  "]}), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"column 'prompt': row 1: the prompt is empty"):
        table_prompts(_source("parquet", tmp_path / "empty.parquet"), "e", None, "w")
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]}),
                   tmp_path / "answered.parquet")
    with pytest.raises(DataError, match=r"row 0: the last message is the assistant's"):
        table_prompts(_source("parquet", tmp_path / "answered.parquet"), "e", None, "w")
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [3.0, 12]}), tmp_path / "numbers.parquet")
    answers = table_prompts(_source("parquet", tmp_path / "numbers.parquet"), "e", None, "w")["answer"].to_pylist()
    assert answers == ["3.0", "12.0"]  # str() of each number, as a JSONL row's (Arrow reads [3.0, 12] as doubles)


def test_folder_splits_pick_the_hub_files(tmp_path):
    folder = tmp_path / "set" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["t1", "t2"]}), folder / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"prompt": ["t3"]}), folder / "train-00001-of-00002.parquet")
    pq.write_table(pa.table({"prompt": ["v1"]}), folder / "test-00000-of-00001.parquet")
    train = table_prompts(_source("parquet", tmp_path / "set", split="train"), "e", None, "w")
    assert [m[0]["content"] for m in train["messages"].to_pylist()] == ["t1", "t2", "t3"]
    with pytest.raises(DataError, match=r"^w\.split: .* holds several splits \(test, train\); set split to one$"):
        table_prompts(_source("parquet", tmp_path / "set"), "e", None, "w")
    with pytest.raises(DataError, match=r"^w\.split: no split 'validation' in .* \(its splits: test, train\)$"):
        table_prompts(_source("parquet", tmp_path / "set", split="validation"), "e", None, "w")


# --- identity: the content, never the path ----------------------------------------------------------------------


def _rl_config(path: Path, columns: str = '{ prompt = "question" }') -> RlConfig:
    return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", [
        f'algorithm.rl.envs[0].source={{ type = "parquet", path = "{path}", columns = {columns} }}'])


def test_identity_is_the_tables_content_not_its_path(tmp_path):
    table = _table(_rows("rl-tiny-prompts.jsonl"), {"prompt": "question"})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, moved = _write(table, "parquet", tmp_path / "a"), _write(table, "parquet", tmp_path / "b")
    assert training_hash(_rl_config(first)) == training_hash(_rl_config(moved))
    other = _write(table.slice(1), "parquet", tmp_path)
    assert training_hash(_rl_config(other)) != training_hash(_rl_config(first))

    def sft_key(path):
        config = load_config(SftConfig, ROOT / "configs/sft-tiny.toml",
                             [f'algorithm.sft.dataset={{ type = "parquet", path = "{path}" }}'])
        return dataset_identity(config, "train")

    sft = _table(_rows("sft-tiny.jsonl"))
    (tmp_path / "c").mkdir()
    (tmp_path / "d").mkdir()
    keys = [sft_key(_write(sft, "parquet", tmp_path / "c")), sft_key(_write(sft, "parquet", tmp_path / "d"))]
    assert keys[0] == keys[1] and str(tmp_path) not in json.dumps(keys[0])
    assert sft_key(_write(sft.slice(1), "parquet", tmp_path)) != keys[0]


def test_a_rewritten_file_is_hashed_again(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a"]}), path)
    before = content_digest(_source("parquet", path))
    pq.write_table(pa.table({"prompt": ["b"]}), path)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime, whatever the clock's resolution
    assert content_digest(_source("parquet", path)) != before


# --- bad input: one line, exit 2, before anything runs ----------------------------------------------------------


def _dry_run_error(capsys, entry_point: str, *overrides: str) -> str:
    args = ["train", entry_point, "--config", f"configs/{entry_point}-tiny.toml", "--dry-run"]
    for override in overrides:
        args += ["--set", override]
    capsys.readouterr()  # what writing the data printed (datasets' progress bars)
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_mapped_column_that_does_not_exist(tmp_path, capsys):
    path = _write(_table(_rows("rl-tiny-prompts.jsonl"), {"prompt": "question"}), "parquet", tmp_path)
    line = _dry_run_error(capsys, "rl", f'algorithm.rl.envs[0].source={{ type = "parquet", path = "{path}", '
                                        'columns = { prompt = "problem" } }')
    assert line == (f"rollout: error: algorithm.rl.envs[0].source.columns.prompt: no column 'problem' in {path} "
                    "(its columns: messages, question)")


def test_a_table_without_rollouts_columns_names_the_ones_present(tmp_path, capsys):
    path = _write(_table(_rows("sft-tiny.jsonl"), {"messages": "chat", "prompt": "q", "completion": "a"}),
                  "arrow", tmp_path)
    line = _dry_run_error(capsys, "sft", f'algorithm.sft.dataset={{ type = "arrow", path = "{path}" }}')
    assert line.startswith(f"rollout: error: algorithm.sft.dataset: {path} has no 'messages' column and no "
                           "'prompt' + 'completion' columns (rollout's names; its columns: a, chat, q);")
    assert "map the table's own with algorithm.sft.dataset.columns" in line


def test_a_missing_path(tmp_path, capsys):
    line = _dry_run_error(capsys, "rm", f'algorithm.rm.dataset={{ type = "parquet", path = "{tmp_path}/nope" }}')
    assert line.startswith(f"rollout: error: configs/rm-tiny.toml: algorithm.rm.dataset.path: no file or folder "
                           f"{tmp_path}/nope")


def test_a_split_that_does_not_exist(tmp_path, capsys):
    path = _write(_table(_rows("rm-tiny.jsonl")), "hf_disk", tmp_path)
    line = _dry_run_error(capsys, "rm", f'algorithm.rm.dataset={{ type = "hf_disk", path = "{path}", '
                                        'split = "test" }')
    assert line == f"rollout: error: algorithm.rm.dataset.split: no split 'test' in {path} (its splits: train)"


@pytest.mark.slow  # a fresh interpreter imports the CLI: ~6 s
def test_datasets_not_installed_names_the_extra(tmp_path):
    """`datasets` absent (sys.modules[name] = None: Python's own way to make an import fail): one line naming the
    extra, exit 2."""
    path = _write(_table(_rows("rm-tiny.jsonl")), "hf_disk", tmp_path)
    script = ("import sys; sys.modules['datasets'] = None\n"
              "from rollout_cli.main import main\n"
              f"sys.exit(main(['train', 'rm', '--config', 'configs/rm-tiny.toml', '--dry-run', '--set', "
              f"'algorithm.rm.dataset={{ type = \"hf_disk\", path = \"{path}\" }}']))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "rollout: error: algorithm.rm.dataset: type = \"hf_disk\" needs the `datasets` package, which is not "
        "installed: pip install -e '.[datasets]' (scripts/setup.sh installs it)"]


def test_a_column_rollout_does_not_read(tmp_path):
    path = _write(_table(_rows("rm-tiny.jsonl")), "parquet", tmp_path)
    with pytest.raises(DataError, match=r"^algorithm\.rm\.dataset\.columns\.response: rollout reads no column "
                                        r"'response' here; it reads prompt, chosen, rejected, margin$"):
        read_pairs(_source("parquet", path, {"response": "chosen"}), "algorithm.rm.dataset")


# --- a million prompts stay in Arrow ----------------------------------------------------------------------------

_MILLION = """
import resource, sys, time
import numpy as np, pyarrow as pa, pyarrow.compute as pc, pyarrow.parquet as pq
from types import SimpleNamespace
from rollout_lib.data.prompts import table_prompts
from rollout_lib.identity.digests import content_digest
from rollout_lib.rl.prompts import check_distinct_examples, select_prompts
from rollout_lib.reward.tables import prompt_messages

rows = 1_000_000
numbers = pa.array(np.arange(rows)).cast(pa.string())
pq.write_table(pa.table({"question": pc.binary_join_element_wise("What is ", numbers, " + 1?", ""),
                         "answer": numbers}), sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
source = SimpleNamespace(type="parquet", path=sys.argv[1], split=None, columns={"prompt": "question"})
content_digest(source)
prompts = table_prompts(source, "big", None, "w")
check_distinct_examples({"big": prompts})
planned = time.perf_counter()
drawn = select_prompts(prompts, 8, seed=1, step=0, env_index=0)
messages = prompt_messages(prompts, drawn.column("example_id").to_pylist())
print(prompts.num_rows, planned - started, time.perf_counter() - planned, len(messages),
      (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.slow
def test_a_million_row_prompt_set_plans_and_draws_without_python_rows(tmp_path):
    done = subprocess.run([sys.executable, "-c", _MILLION, str(tmp_path / "big.parquet")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "ROLLOUT_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    rows, plan_s, draw_s, messages, grown_mib = done.stdout.split()
    assert (int(rows), int(messages)) == (1_000_000, 8)
    # A million rows as Python dicts of messages take over 1 GiB and tens of seconds; in Arrow ~100 MiB.
    assert float(grown_mib) < 600, grown_mib
    assert float(plan_s) < 10 and float(draw_s) < 1, (plan_s, draw_s)


# --- training from a table --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_from_parquet_trains_the_checkpoint_jsonl_trains_and_rl_draws_the_same_prompts(tmp_path, prefect_server):
    """Two steps each, separate stores (no shared cache): SFT from a parquet copy of sft-tiny.jsonl ends at the
    JSONL run's checkpoint id (the bytes of the weights), and RL from a parquet copy of its prompts gets the JSONL
    run's rewards."""
    from clirun import train_in_process

    sft = _write(_table(_rows("sft-tiny.jsonl")), "parquet", tmp_path)
    common = ("train", "sft", "--config", "configs/sft-tiny.toml", "--max-steps", "2")
    from_jsonl = train_in_process(*common, "--store", str(tmp_path / "store-jsonl"))
    from_table = train_in_process(*common, "--set", f'algorithm.sft.dataset={{ type = "parquet", path = "{sft}" }}',
                                  "--store", str(tmp_path / "store-table"))
    assert from_table["checkpoint"] == from_jsonl["checkpoint"]

    (tmp_path / "rl").mkdir()
    prompts = _write(_table(_rows("rl-tiny-prompts.jsonl"), {"prompt": "question"}), "arrow", tmp_path / "rl")
    common = ("train", "rl", "--config", "configs/rl-tiny.toml", "--max-steps", "2")
    from_jsonl = train_in_process(*common, "--store", str(tmp_path / "rl-jsonl"))
    from_table = train_in_process(*common, "--set", f'algorithm.rl.envs[0].source={{ type = "arrow", path = '
                                                    f'"{prompts}", columns = {{ prompt = "question" }} }}',
                                  "--store", str(tmp_path / "rl-table"))
    assert from_table["reward_curve"] == from_jsonl["reward_curve"]
