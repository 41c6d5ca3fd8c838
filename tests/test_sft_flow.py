"""train-sft end to end through the CLI and a real Prefect server: training with packing and a held-out set,
export to a `from_pretrained` directory that generates, and the resume proof: SIGKILL mid-training, rerun, the
same final checkpoint id as an uninterrupted run, with the completed tasks back from cache."""

from __future__ import annotations

import json
import subprocess

import pytest

from clirun import (
    ROOT,
    cli_env,
    final_result,
    rollout_command,
    run_rollout,
    run_until_then_kill,
    task_run_states,
    train_in_process,
)
from rollout_lib.store import ObjectStore

pytestmark = pytest.mark.slow

CHATS = [
    {"prompt": "What is 12 + 30?", "completion": "The answer is 42."},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                  {"role": "assistant", "content": "Hello there, friend!"}]},
    {"messages": [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"},
                  {"role": "user", "content": "And 2+2?"}, {"role": "assistant", "content": "4, since 2 + 2 = 4."}]},
    {"prompt": "Please write a short poem about the sea.", "completion": "The sea and the sky, blue and wide."},
    {"prompt": "She has 7 apples and gives away 2. How many are left?", "completion": "She has 5 apples left."},
    {"messages": [{"role": "user", "content": "Hello!"},
                  {"role": "assistant", "content": "Hello! How can I help you today?"}]},
]

# Held out: never trained on, in the same style (short answers after the same chat template), so a falling eval
# loss shows the model learnt something that carries over rather than memorised its training rows.
HELD_OUT = [
    {"prompt": "What is 20 + 3?", "completion": "The answer is 23."},
    {"messages": [{"role": "user", "content": "Hi there!"},
                  {"role": "assistant", "content": "Hi! What can I do for you?"}]},
    {"prompt": "He has 9 pears and eats 3. How many are left?", "completion": "He has 6 pears left."},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def chat_data(tmp_path):
    return write_jsonl(tmp_path / "chats.jsonl", CHATS)


@pytest.fixture
def held_out_data(tmp_path):
    return write_jsonl(tmp_path / "held-out.jsonl", HELD_OUT)


def test_train_sft_tiny_packed_with_eval_then_export_and_generate(prefect_server, tmp_path, chat_data,
                                                                  held_out_data):
    store = tmp_path / "store"
    done = run_rollout("train", "sft", "--config", "configs/sft-tiny.toml", "--set", f"run.store={store}",
                       "--set", f"algorithm.sft.dataset.path={chat_data}",
                       "--set", f"algorithm.sft.eval_dataset.path={held_out_data}",
                       "--set", "algorithm.sft.packing.kind=on", "--set", "algorithm.sft.packing.max_seq_len=128",
                       "--set", "algorithm.sft.budget.max_steps=4", "--set", "algorithm.sft.optimizer.lr=0.05")
    assert done.returncode == 0, done.stderr[-3000:]
    result = final_result(done)
    checkpoint = result["checkpoint"]
    assert ObjectStore(str(store)).get_ref("runs/sft-tiny/latest") == checkpoint
    assert result["eval_before"]["tokens"] == result["eval_after"]["tokens"] == 32  # held-out's (training's: 66)
    assert result["eval_after"]["loss"] < result["eval_before"]["loss"]
    assert "100.0% of processed positions real" in done.stdout + done.stderr  # packing: no padding at all

    states = task_run_states(result["flow_run_id"])
    assert {"load-examples-train", "load-examples-eval", "tokenize-examples-train", "plan-batches",
            "pack-micro-batches", "init-model", "train-steps-1-1", "train-steps-4-4", "evaluate-step-0",
            "evaluate-step-4"} <= set(states)
    assert set(states.values()) == {"Completed"}

    out = tmp_path / "hf"
    exported = run_rollout("export", "--checkpoint", "runs/sft-tiny/latest", "--out", str(out), "--store", str(store))
    assert exported.returncode == 0, exported.stderr[-2000:]
    generate = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]); tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'What is 12 + 30?'}], add_generation_prompt=True,"
        " return_tensors='pt', return_dict=True)\n"
        "out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)\n"
        "print('GENERATED', out.shape[1] - ids['input_ids'].shape[1])\n"
    )
    generated = subprocess.run([*rollout_command()[:1], "-c", generate, str(out)], cwd=ROOT, env=cli_env(),
                               capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert int(generated.stdout.split("GENERATED")[1]) > 0


def test_sigkill_mid_training_then_rerun_matches_uninterrupted_run(prefect_server, tmp_path, chat_data):
    steps = ["--set", f"algorithm.sft.dataset.path={chat_data}", "--set", "algorithm.sft.budget.max_steps=12",
             "--set", "algorithm.sft.checkpoint_interval=4", "--set", "algorithm.sft.optimizer.kind=adamw",
             "--set", "algorithm.sft.optimizer.lr=1e-2"]
    expected = train_in_process("train", "sft", "--config", "configs/sft-tiny.toml", *steps,
                                "--set", f"run.store={tmp_path / 'uninterrupted'}")["checkpoint"]

    store = tmp_path / "interrupted"
    args = ["train", "sft", "--config", "configs/sft-tiny.toml", *steps, "--set", f"run.store={store}"]
    # Kill inside the last segment (steps 9-12), after its step 10 (ROLLOUT_LOG_LEVEL=DEBUG logs every step).
    killed_log = run_until_then_kill(args, "step 10: ", tmp_path / "killed.log",
                                     env=cli_env(ROLLOUT_LOG_LEVEL="DEBUG"))
    assert "train-steps-5-8' - Finished" in killed_log and "train-steps-9-12' - Finished" not in killed_log
    assert ObjectStore(str(store)).get_ref("runs/sft-tiny/latest") is None

    rerun = run_rollout(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    result = final_result(rerun)
    assert result["checkpoint"] == expected  # the same final checkpoint id, byte for byte

    states = task_run_states(result["flow_run_id"])
    for name in ["load-examples-train", "tokenize-examples-train", "plan-batches", "pack-micro-batches",
                 "init-model", "train-steps-1-4", "train-steps-5-8"]:
        assert states[name] == "Cached", (name, states)
    assert states["train-steps-9-12"] == "Completed"  # only the interrupted segment ran again
