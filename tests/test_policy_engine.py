"""The live policy on a vLLM engine (sampling/vllm.py, serving/policy_server.py): its settings and what enters the
training identity, every rollout recording what sampled it, weight reload in place verified by a probe (tied
embeddings included), the probe failing loudly on other weights, seeded sampling through the pool, a policy server
killed mid-stage or inside its hold (the reload, the probe), and `train rl` runs on the engine, one of them killed and
rerun.

One policy server (tiny:qwen2, dev mode) serves the class below and is stopped after it; the `train rl` tests after
it start their runs' own. Never the session's `vllm_tiny`: reloading other weights into it would break other tests.
The interrupted run's rerun must end on an uninterrupted run's checkpoint (a module fixture)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import signal
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rollout_lib import wire
from rollout_lib.config import ConfigError, RlConfig
from rollout_lib.plan_checks import load_config
from rollout_lib.config.common import ModelRef
from rollout_lib.envs import build_interaction
from rollout_lib.envs.calculator import CalculatorSettings
from rollout_lib.model.loading import load_tokenizer, model_content_digest, resolve_model
from rollout_lib.identity.rl_training import frozen_identity
from rollout_lib.rl.sample import build_samplers
from rollout_lib.sampling import SAMPLERS, SamplingContext, SamplingParams
from rollout_lib.sampling.base import encode_prompt
from rollout_lib.sampling.vllm import VllmSampler, VllmSamplerSettings
from rollout_lib.serving import engine, weight_sync
from rollout_lib.serving.client import EndpointClient
from rollout_lib.serving.served import ServedModels
from rollout_lib.serving.policy_server import (
    HoldReport,
    PolicyReplicaLost,
    PolicyServerError,
    PolicyServerSpec,
    trainer_logprobs,
)
from rollout_lib.serving.settings import ExternalModel, ServedModel
from rollout_lib.identity.training import training_identity

BASE = ModelRef(uri="tiny:qwen2")
ROOT = Path(__file__).resolve().parent.parent


def rl_tiny(tmp_path, *overrides: str) -> RlConfig:
    return load_config(RlConfig, ROOT / "configs/rl-tiny.toml", [f"run.store={tmp_path / 'store'}", *overrides])


# --- settings and records, no server ----------------------------------------------------------------------------


def test_the_engine_is_a_policy_sampler_type_and_only_the_type_enters_the_training_identity(tmp_path):
    default = rl_tiny(tmp_path)
    assert default.settings.policy_sampler.type == "hf"  # the embedded sampler stays the default
    engine_run = rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm" }')
    assert isinstance(engine_run.settings.policy_sampler, VllmSamplerSettings)
    assert engine_run.settings.policy_sampler.tolerance == 1e-3
    resized = rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm", replicas = 2, concurrency = 4, '
                                'timeout_s = 5, probe_tolerance = 1e-2, max_recoveries = 0 }')
    assert training_identity(resized) == training_identity(engine_run) != training_identity(default)
    with pytest.raises(ConfigError, match=r"algorithm\.rl\.policy_sampler\.replicas"):
        rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm", replicas = 0 }')


def server_flags(config) -> list[str]:
    """The policy server's flags beyond engine.SERVER_FLAGS (which start it in float32, eager)."""
    return config.settings.policy_sampler.server_spec(BASE, torch.nn.Linear(1, 1)).server_args()


def test_the_engines_precision_and_compilation_are_server_flags_and_enter_the_identity(tmp_path):
    fp32 = rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm", dtype = "float32", compile = false }')
    assert server_flags(fp32) == []  # engine.SERVER_FLAGS: float32, eager
    bf16 = rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm", dtype = "bfloat16" }')
    compiled = rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm", dtype = "bfloat16", compile = true }')
    assert server_flags(bf16) == ["--dtype", "bfloat16"]  # after SERVER_FLAGS: last wins
    assert server_flags(compiled) == ["--dtype", "bfloat16", "--no-enforce-eager"]
    assert bf16.settings.policy_sampler.tolerance == 2.0  # bfloat16 rounding: serving/policy_server.py
    assert rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm", dtype = "bfloat16", '
                             'probe_tolerance = 0.5 }').settings.policy_sampler.tolerance == 0.5
    # They decide the sampled tokens: each its own identity; the defaults spelt out change nothing.
    identities = {training_identity(config) for config in (fp32, bf16, compiled)}
    assert len(identities) == 3 and training_identity(fp32) == training_identity(
        rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm" }'))
    with pytest.raises(ConfigError, match=r"algorithm\.rl\.policy_sampler\.dtype"):
        rl_tiny(tmp_path, 'algorithm.rl.policy_sampler={ type = "vllm", dtype = "float16" }')


def test_every_rollout_records_what_sampled_it(tmp_path, tiny_model_dir):
    """The embedded sampler: the policy state id given to the stage; a frozen source: its identity; the engine
    sampler without the run's served models: a clear error, never a silent fallback."""
    config = rl_tiny(tmp_path)
    tokenizer = load_tokenizer(resolve_model(str(tiny_model_dir)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sampler = build_samplers(config, model, tokenizer, policy_state="f" * 64)["words"]
    table = sampler.sample(prompts(), SamplingParams(group_size=2, max_tokens=4), seed=0)
    assert table.column("sampled_from").to_pylist() == ["f" * 64] * 4
    assert frozen_identity(config, ExternalModel(base_url="http://127.0.0.1:9", name="teacher")) == \
        "frozen:served:teacher"
    assert frozen_identity(config, ServedModel(model="tiny:qwen2")) == f"frozen:{model_content_digest(BASE)}"
    with pytest.raises(ValueError, match='type = "vllm" samples on the run\'s policy server'):
        VllmSampler(VllmSamplerSettings(), model, tokenizer, SamplingContext(policy_state="s"))


class _ServerLosingItsReplica:
    """A policy server whose first `losses` holds lose their replica (PolicyReplicaLost, as a SIGKILL inside the reload
    gives) and whose `recover` restarts `restarts` (none: a server on another node, or a replica hung, not dead)."""

    name = "policy-fake"
    remote = False

    def __init__(self, losses: int, restarts: list[str]):
        self.losses, self.restarts, self.holds, self.recovers = losses, restarts, 0, 0

    def policy_server(self, *_, **__):  # the run's ServedModels hands out this server
        return self

    def hold(self, state_id, model, tokenizer):
        self.holds += 1
        if self.holds <= self.losses:
            raise PolicyReplicaLost("policy server http://127.0.0.1:9 ('policy-fake'): weight reload failed: POST "
                                    "/collective_rpc: ReadError")
        return HoldReport(reloaded=["http://127.0.0.1:9"])

    def recover(self) -> list[str]:
        self.recovers += 1
        return list(self.restarts)


@pytest.mark.parametrize("losses, restarts, max_recoveries, holds, recovers, fails", [
    (1, ["http://127.0.0.1:9"], 2, 2, 1, False),  # lost inside the hold: restarted, held again
    (1, [], 2, 1, 1, True),  # nothing died (another node's server, or hung): the hold's one line stands
    (3, ["http://127.0.0.1:9"], 2, 3, 2, True),  # lost again and again: max_recoveries restarts a stage, then fails
])
def test_a_replica_lost_inside_the_hold_is_restarted_and_held_again_within_the_stages_recoveries(
        losses, restarts, max_recoveries, holds, recovers, fails):
    server = _ServerLosingItsReplica(losses, restarts)
    context = SamplingContext(policy_state="state-a", served_models=server, base_model=BASE)
    sampler = VllmSampler(VllmSamplerSettings(max_recoveries=max_recoveries), torch.nn.Linear(1, 1), None, context)
    if fails:
        with pytest.raises(PolicyReplicaLost, match=r"^policy server http://127\.0\.0\.1:9 \('policy-fake'\): weight "
                                                    r"reload failed: POST /collective_rpc: ReadError$"):
            sampler.sync()
        assert sampler.held_state is None
    else:
        sampler.sync()
        assert sampler.held_state == "state-a" and len(sampler.hold_reports) == 1
    assert (server.holds, server.recovers, sampler.recoveries) == (holds, recovers, recovers if restarts else 0)


# --- against a policy server ------------------------------------------------------------------------------------


def _collective_rpc(server, method: str, **call):
    """Call the policy server's worker `method` directly, as the policy server does (POST /collective_rpc)."""
    async def call_it():
        client = EndpointClient(server.deployment.base_urls[0], server.served_name, timeout_s=120)
        try:
            return (await client.request("POST", "/collective_rpc", {"method": method, **call}))["results"][0]
        finally:
            await client.aclose()
    return asyncio.run(call_it())


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of `model` with every parameter moved (the tied embeddings, so the output head, included)."""
    changed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in changed.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return changed


def synced(sampler: VllmSampler) -> VllmSampler:
    """A sampler after its stage's weight sync (tasks/rl.py does it before a stage samples)."""
    sampler.sync()
    return sampler


def prompts(n: int = 2) -> pa.Table:
    rows = [{"example_id": f"e/{i}", "env": "e", "messages": [{"role": "user", "content": f"Say {i} things."}],
             "answer": str(i), "info": None, "source_line": i + 1} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=wire.PROMPTS)


@pytest.fixture(scope="class")
def served(tiny_model_dir):
    """A run's ServedModels with its policy server started, the base policy and its tokenizer."""
    tokenizer = load_tokenizer(resolve_model(str(tiny_model_dir)))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with ServedModels() as frozen:
        server = frozen.policy_server(PolicyServerSpec(BASE))
        yield frozen, server, base, tokenizer
    assert engine.find_deployment(server.name) is None  # stopped by close()
    assert not any(directory.exists() for directory in engine.weights_dirs(server.name))  # its weights file freed


@pytest.mark.slow
class TestPolicyServer:
    def test_a_reload_serves_the_trainers_weights_tied_embeddings_included(self, served):
        _, server, base, tokenizer = served
        deployment = engine.find_deployment(server.name)
        assert deployment.live_policy and deployment.env[engine.DEV_MODE_ENV] == "1"
        assert deployment.base_urls == server.deployment.base_urls
        assert base.config.tie_word_embeddings  # the trap this guards against is live on the tiny model

        model = perturbed(base, seed=1)
        report = server.hold("state-a", model, tokenizer)
        assert report.reloaded == server.deployment.base_urls and report.max_probe_diff < 1e-4
        assert set(server.reload_paths.values()) == {"in place"}  # engine_reload.py's short path, not vLLM's
        assert server.holds("state-a") and not server.holds("state-b")
        # Another sequence than the probe (a chat prompt and a reply): served logprobs are the trainer's.
        ids = encode_prompt(tokenizer, [{"role": "user", "content": "Count the waves."}])
        ids += tokenizer("one two three, the sea", add_special_tokens=False)["input_ids"]
        served_logprobs = asyncio.run(server.pool.score(ids))
        assert max(abs(a - b) for a, b in zip(served_logprobs, trainer_logprobs(model, ids))) < 1e-4
        # The weights file carries the output head, a copy of the new embeddings.
        written = load_file(server.weights.path)
        assert torch.equal(written["lm_head.weight"], model.get_input_embeddings().weight)
        # The same state again: nothing reloads.
        assert server.hold("state-a", model, tokenizer).reloaded == []

    def test_the_probe_fails_loudly_on_a_server_holding_other_weights(self, served, tmp_path):
        _, server, base, tokenizer = served
        model = perturbed(base, seed=1)
        server.hold("state-a", model, tokenizer)
        other = perturbed(base, seed=2)
        with pytest.raises(PolicyServerError) as raised:
            server.check("state-other", other, tokenizer)
        message = str(raised.value)
        assert server.deployment.base_urls[0] in message and "state-other" in message
        assert "differ from the trainer's by up to" in message and "tolerance 0.001" in message

        # The tied-embeddings trap: weights written without lm_head (as save_pretrained writes them) leave vLLM's
        # own reload_weights with its output head on the old embeddings, and the probe refuses the state. The
        # in-place path packs the head again from the new embeddings, so it does not fall in (the policy server
        # writes lm_head all the same, weight_sync.py, for vLLM's path).
        without_head = {name: tensor.clone() for name, tensor in weight_sync.state_tensors(other).items()
                        if name != "lm_head.weight"}
        save_file(without_head, str(tmp_path / "model.safetensors"))
        _collective_rpc(server, "reload_weights", kwargs={"weights_path": str(tmp_path)})
        with pytest.raises(PolicyServerError, match="does not hold policy state state-b") as raised:
            server.check("state-b", other, tokenizer)
        difference = re.search(r"differ from the trainer's by up to (\S+) \(tolerance", str(raised.value))
        assert float(difference.group(1)) > 0.1
        assert _collective_rpc(server, "reload_policy_weights", args=[str(tmp_path)]) == "in place"
        assert server.check("state-b", other, tokenizer) < 1e-4
        server._holds.clear()  # the replica was reloaded behind the server's back

    def test_the_in_place_reload_serves_what_vllms_own_reload_serves_bit_for_bit(self, served, tmp_path):
        _, server, base, tokenizer = served
        model = perturbed(base, seed=3)
        server.hold("state-c", model, tokenizer)
        ids = encode_prompt(tokenizer, [{"role": "user", "content": "Count the waves."}])
        in_place = asyncio.run(server.pool.score(ids))
        _collective_rpc(server, "reload_weights", kwargs={"weights_path": str(server.weights.directory)})
        assert asyncio.run(server.pool.score(ids)) == in_place  # the same packing of the same weights
        # A checkpoint the short path cannot take whole (a tensor missing) is refused before anything changes and
        # goes to vLLM's reload_weights, which says so.
        partial = {name: tensor for name, tensor in weight_sync.state_tensors(model).items()
                   if name != "model.norm.weight"}
        save_file({name: tensor.clone() for name, tensor in partial.items()}, str(tmp_path / "model.safetensors"))
        path = _collective_rpc(server, "reload_policy_weights", args=[str(tmp_path)])
        assert path == "vllm reload_weights (the checkpoint has no model.norm.weight)"
        assert asyncio.run(server.pool.score(ids)) == in_place  # what it loaded is what was there; the norm kept
        server._holds.clear()

    def test_sampling_on_the_engine_keeps_the_rollouts_contract_and_records_the_state(self, served):
        frozen, server, base, tokenizer = served
        model = perturbed(base, seed=3)
        context = SamplingContext(policy_state="state-c", served_models=frozen, base_model=BASE)
        assert SAMPLERS["vllm"] is VllmSampler
        sampler = VllmSampler(VllmSamplerSettings(), model, tokenizer, context)
        assert sampler.server is server  # the run's one server
        sampler.sync()  # the stage's weight sync, before it samples
        params = SamplingParams(group_size=3, max_tokens=8)
        table = sampler.sample(prompts(), params, seed=11)
        assert table.schema == wire.ROLLOUTS and table.num_rows == 6
        assert table.column("sampled_from").to_pylist() == ["state-c"] * 6
        assert [report.reloaded for report in sampler.hold_reports] == [server.deployment.base_urls]
        rows = table.to_pylist()
        for row in rows:
            assert 1 <= len(row["completion_ids"]) <= 8 and len(row["sampling_logprobs"]) == len(row["completion_ids"])
            # The engine's logprobs are those of the trainer's weights (temperature 1: the raw distribution).
            full = row["prompt_ids"] + row["completion_ids"]
            expected = trainer_logprobs(model, full)[len(row["prompt_ids"]) - 1:]
            assert max(abs(a - b) for a, b in zip(row["sampling_logprobs"], expected)) < 1e-3
        again = synced(VllmSampler(VllmSamplerSettings(concurrency=1), model, tokenizer, context)).sample(
            prompts(), params, seed=11)
        assert again.column("completion_ids").to_pylist() == table.column("completion_ids").to_pylist()
        assert len({tuple(ids) for ids in table.column("completion_ids").to_pylist()}) > 1

    def test_multi_turn_episodes_play_on_the_engine_reproducibly(self, served):
        frozen, _, base, tokenizer = served
        context = SamplingContext(policy_state="state-e", served_models=frozen, base_model=BASE)
        sampler = synced(VllmSampler(VllmSamplerSettings(), perturbed(base, seed=5), tokenizer, context))
        params = SamplingParams(group_size=3, max_tokens=6)
        interaction = build_interaction(CalculatorSettings())
        first = sampler.sample(prompts(), params, 7, interaction=interaction, context_limit=128)
        again = sampler.sample(prompts(), params, 7, interaction=interaction, context_limit=128)
        assert first.column("completion_ids").equals(again.column("completion_ids")) and first.num_rows == 6
        assert first.column("sampled_from").to_pylist() == ["state-e"] * 6
        for row in first.to_pylist():
            assert row["episode"] is not None and len(row["sampling_logprobs"]) == len(row["completion_ids"])
            sampled = [i for turn in row["completion_turns"] if turn["sampled"]
                       for i in range(turn["start"], turn["start"] + turn["length"])]
            assert sampled and all(row["sampling_logprobs"][i] <= 0 for i in sampled)

    def test_a_policy_server_killed_mid_stage_is_restarted_reloaded_and_the_stage_completes(self, served):
        frozen, server, base, tokenizer = served
        model = perturbed(base, seed=4)
        context = SamplingContext(policy_state="state-d", served_models=frozen, base_model=BASE)
        params = SamplingParams(group_size=4, max_tokens=8)
        expected = synced(VllmSampler(VllmSamplerSettings(), model, tokenizer, context)).sample(prompts(), params,
                                                                                                seed=5)

        sampler = synced(VllmSampler(VllmSamplerSettings(concurrency=2), model, tokenizer, context))
        pool, calls, killed = server.pool, [], []
        original = pool.generate

        async def generate_then_kill(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:  # the third request of the stage: the server dies under it and its neighbours
                pid = server.deployment.replicas[0].pid
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
            return await original(*args, **kwargs)

        pool.generate = generate_then_kill
        table = sampler.sample(prompts(), params, seed=5)
        assert killed and server.deployment.replicas[0].pid != killed[0]  # restarted: a new process
        assert server.pool is not pool and server.holds("state-d")
        reloads = [report.reloaded for report in sampler.hold_reports]
        assert reloads == [[], server.deployment.base_urls]  # held already; reloaded after the restart
        assert table.column("completion_ids").to_pylist() == expected.column("completion_ids").to_pylist()
        assert table.column("sampled_from").to_pylist() == ["state-d"] * 8


@pytest.mark.slow
def test_a_train_rl_run_samples_on_the_engine_and_records_each_state(prefect_server, tmp_path):
    """rl-tiny for 3 steps with the policy on the engine, evaluated on held-out prompts on the engine too: every
    step's rollouts name the state they were sampled from (the initial checkpoint, step 1's and step 2's records),
    each state is loaded once and passed its probe, and the run stopped its policy server."""
    from clirun import final_result, run_rollout

    from rollout_lib.rl.policy import STEP_STATE_KIND
    from rollout_lib.runlog.eval_tables import read_rl_eval_tables, recorded_rl_evals
    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.store import ObjectStore

    store_root = tmp_path / "store"
    completed = run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--set",
                            "algorithm.rl.budget.max_steps=3", "--set", "algorithm.rl.checkpoint_interval=2", "--set",
                            'algorithm.rl.policy_sampler={ type = "vllm", concurrency = 8 }',
                            "--set", 'algorithm.rl.envs[0].eval={ source = { type = "jsonl_path", path = '
                                     '"data/rlhf-heldout-prompts.jsonl" }, every = 2 }',
                            "--set", f"run.store={store_root}", "--set", "run.name=rl-engine")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert len(final_result(completed)["reward_curve"]) == 3
    store = ObjectStore(str(store_root))
    step_0, *steps = read_metrics(store, "rl-engine")  # step 0: the held-out evaluation before training, alone
    assert step_0["step"] == 0 and "eval/words/reward_mean" in step_0 and "reward_mean" not in step_0
    assert [record["step"] for record in steps] == [1, 2, 3]
    after = steps[-1]["eval/words/reward_mean"]
    assert f"held-out after training: eval/words/reward_mean {after:.3f}" in completed.stdout + completed.stderr
    # A new state every step, each loaded once: by the step that samples from it, or by the held-out evaluation
    # that ran on it (before step 1; after step 2 the evaluation runs beside step 3's sampling, so either of them
    # loads state 2, never both); every reload within the tolerance.
    reloads = [record["policy_server/reloads"] for record in steps]
    assert reloads[:2] == [0, 1] and reloads[2] in (0, 1)
    assert steps[1]["policy_server/probe_diff"] < 1e-3
    loaded = re.findall(r"reloading \S+ to state ([0-9a-f]{64})", completed.stdout + completed.stderr)
    assert len(loaded) == len(set(loaded)) == 4, loaded  # the initial state, states 1, 2 and 3: once each
    assert [record["step"] for record in steps if "eval/words/reward_mean" in record] == [2, 3]

    # The held-out evaluations keep their samples too (`rollout runs samples --eval`): apart, since they ran on the
    # states evaluated (the initial one, 2 and 3), not on those the steps sampled from.
    held_out = {tables["scored"] for step in recorded_rl_evals(store, "rl-engine")
                for tables in read_rl_eval_tables(store, "rl-engine", step)["envs"].values()}
    assert recorded_rl_evals(store, "rl-engine") == [0, 2, 3] and len(held_out) == 3
    sampled_from: set[str] = set()
    evaluated: set[str] = set()
    for object_id in store.list_objects():
        try:
            table = store.get_table(object_id)
        except (OSError, pa.ArrowInvalid):  # not an Arrow table
            continue
        if "sampled_from" in table.column_names and "completion_ids" in table.column_names:
            values = set(table.column("sampled_from").to_pylist())
            assert len(values) == 1 and None not in values, values
            (evaluated if object_id in held_out else sampled_from).update(values)
    assert len(sampled_from) == 3 and all(store.has(state) for state in sampled_from)
    assert len(evaluated) == 3 and len(evaluated & sampled_from) == 2  # state 3 sampled nothing: only evaluated
    records = {store.get_json(state)["step"]: store.get_json(state) for state in sampled_from
               if _is_record(store, state, STEP_STATE_KIND)}
    assert sorted(records) == [1, 2]  # step records, whatever the snapshots: the initial checkpoint, then 1 and 2
    assert records[1]["parent"] in sampled_from and records[2]["parent"] in sampled_from
    assert not [d for d in engine.running_deployments() if d.live_policy]  # the run stopped its server


def _is_record(store, object_id: str, kind: str) -> bool:
    try:
        return json.loads(store.get_bytes(object_id)).get("kind") == kind
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


# rl-tiny for 2 steps on the engine (one to resume from, one to sample after the kill), one request at a time: which
# token a seed draws may depend on the engine's batch composition (its logits vary in the last bits).
ENGINE_RUN = ["train", "rl", "--config", "configs/rl-tiny.toml", "--set", "algorithm.rl.budget.max_steps=2",
              "--set", "algorithm.rl.checkpoint_interval=2",
              "--set", 'algorithm.rl.policy_sampler={ type = "vllm", concurrency = 1 }']


@pytest.fixture(scope="module")
def uninterrupted_engine_run(prefect_server, tmp_path_factory) -> tuple[Path, dict]:
    """ENGINE_RUN uninterrupted, in this process: its store and its result, what every interrupted run below must
    end on."""
    from clirun import train_in_process

    store = tmp_path_factory.mktemp("uninterrupted-engine") / "store"
    return store, train_in_process(*ENGINE_RUN, "--set", f"run.store={store}")


@pytest.mark.slow
def test_a_run_killed_mid_way_adopts_its_orphan_whose_kills_inside_its_reload_then_its_probe_end_on_the_same_checkpoint(
        uninterrupted_engine_run, tmp_path, monkeypatch, caplog):
    """Two faults, one rerun (a run fewer for the suite than a test for each). The run is SIGKILLed after step 1
    trained: its policy server is left as an orphan. The rerun adopts it (no second server), returns step 1 from
    cache and, to sample step 2, brings the server to the state after step 1 (issue 46): the server is
    SIGKILLed inside that reload (POST /collective_rpc, the weights written), then, restarted, inside its probe (its
    scoring, the reload done), each with that request in flight. As for a server lost while sampling, the sampler
    restarts it, writes, reloads and probes again (two restarts: the stage's max_recoveries), samples step 2 with
    the same seeds, and the rerun ends on the uninterrupted run's checkpoint, with no further rerun. The kill lands
    inside the phase on a loaded machine and cuts the request under way, as the issue's was (ReadError):
    in_flight.py. The rerun runs in this process (the hooks below watch it); the killed run is the CLI's. Prints the
    seconds from each kill to its restart, from the last kill to the hold done again and to the run's end."""
    import logging

    from clirun import run_until_then_kill, task_run_states, train_in_process
    from in_flight import kill_with_the_request_in_flight

    from rollout_lib.runlog.metrics_file import read_metrics
    from rollout_lib.serving.policy_server import PolicyServer
    from rollout_lib.serving.weight_sync import SharedWeightsFile
    from rollout_lib.store import ObjectStore

    store, expected = uninterrupted_engine_run
    # k = 0 on the engine: the behaviour logprobs are the training forward's own (no recompute forward), and the
    # rerun below still ends on the same checkpoint.
    steps = read_metrics(ObjectStore(str(store)), "rl-tiny")
    assert all(m["behaviour/training_forward"] == 32 and "behaviour/recomputed" not in m for m in steps)
    assert all(m["rl/ratio_mean"] == 1.0 for m in steps)

    args = [*ENGINE_RUN, "--set", f"run.store={tmp_path / 'interrupted'}"]
    run_until_then_kill(args, "train-step-1' - Finished", tmp_path / "killed.log")
    orphans = [d for d in engine.running_deployments() if d.live_policy]
    assert len(orphans) == 1 and orphans[0].orphaned

    events: list[str] = []  # write, reload, probe, kill, restart: in the order they happened
    kills: dict[str, dict] = {}  # phase -> when, the replica, the error, the restart
    # The rerun's first hold (step 2's state on the adopted server) is reload 1: killed; after the restart it holds
    # again (reload 2, probe 1): the probe killed.
    kill_at = {"reload": 1, "probe": 1}
    originals = {name: getattr(PolicyServer, name) for name in ("_reload", "_score", "recover")}
    original_write = SharedWeightsFile.write

    def write(weights, model):
        events.append("write")
        return original_write(weights, model)

    def hooked(name: str, event: str):
        async def call(server, client, url, *args):
            events.append(event)
            request = originals[name](server, client, url, *args)
            if events.count(event) != kill_at[event]:
                result = await request
                if event == "probe" and kills and "held_again" not in kills[next(reversed(kills))]:
                    kills[next(reversed(kills))]["held_again"] = time.monotonic()
                return result
            replica = server.deployment.replicas[0]
            at, in_flight = await kill_with_the_request_in_flight(replica.pid, replica.port, request)
            kills[event] = {"at": at, "pid": replica.pid, "url": replica.base_url}
            events.append("kill")
            try:
                return await in_flight
            except PolicyReplicaLost as lost:
                kills[event]["error"] = str(lost)
                raise
        return call

    def recover(server):
        restarted = originals["recover"](server)
        events.append("restart")
        last = kills[next(reversed(kills))]
        last["restarted"], last["new_pid"] = restarted, server.deployment.replicas[0].pid
        last["restarted_at"] = time.monotonic()
        return restarted

    monkeypatch.setattr(SharedWeightsFile, "write", write)
    monkeypatch.setattr(PolicyServer, "_reload", hooked("_reload", "reload"))
    monkeypatch.setattr(PolicyServer, "_score", hooked("_score", "probe"))
    monkeypatch.setattr(PolicyServer, "recover", recover)
    caplog.set_level(logging.INFO, logger="rollout_lib.serving.served")

    resumed = train_in_process(*args)
    ended = time.monotonic()
    for phase, kill in kills.items():
        print(f"policy server SIGKILLed inside its {phase}: restarted {kill['restarted_at'] - kill['at']:.1f} s after "
              f"the kill ({kill['error']})")
    print(f"held again {kills['probe']['held_again'] - kills['probe']['at']:.1f} s after the probe's kill; the run "
          f"ended {ended - kills['probe']['at']:.1f} s after it")

    assert f"adopting policy server {orphans[0].name} left by a killed run" in caplog.text
    hold = ["write", "reload", "probe"]
    assert events == ["write", "reload", "kill", "restart",  # step 2's hold: killed in its reload
                      "write", "reload", "probe", "kill", "restart",  # held again: killed in its probe
                      *hold]  # held again, then sampled
    for phase, what in [("reload", "weight reload failed: POST /collective_rpc"),
                        ("probe", "scoring the probe failed: POST /v1/completions")]:
        kill = kills[phase]
        assert kill["error"].startswith(f"policy server {kill['url']} ") and what in kill["error"], kill
        assert "unreachable" not in kill["error"]  # cut under way, not refused before it was sent
        assert kill["restarted"] == [kill["url"]] and kill["new_pid"] != kill["pid"]
    assert kills["reload"]["pid"] == orphans[0].pids[0]  # the first kill hit the adopted orphan, not a new server
    states = task_run_states(resumed["flow_run_id"])
    assert [states[f"sample-and-score-step-{k}"] for k in (1, 2)] == ["Cached", "Completed"]
    assert resumed["checkpoint"] == expected["checkpoint"]
    assert resumed["reward_curve"] == expected["reward_curve"]
    assert not [d for d in engine.running_deployments() if d.live_policy]  # the adopter stopped the restarted server
