"""OpenEnv environments (envs/openenv_env.py, openenv_sessions.py) on the example env examples/openenv_guess: an
Environment class in-process and the same class served by its real uvicorn server (started once for this module, a
process on 127.0.0.1) over the WebSocket client. The policy is scripted (fixed turns, one character per token, as in
test_tool_calls.py) where a test pins the episodes; the two 2-step runs sample from tiny:qwen2."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pytest

pytest.importorskip("openenv.core.env_server", reason="openenv-core is not installed (scripts/setup.sh --test)")

from rollout_lib import wire  # noqa: E402
from rollout_lib.config import ConfigError, RlConfig  # noqa: E402
from rollout_lib.plan_checks import load_config  # noqa: E402
from rollout_lib.determinism import derived_seed  # noqa: E402
from rollout_lib.envs import build_interaction  # noqa: E402
from rollout_lib.envs.openenv_env import OpenEnvInteraction, OpenEnvSettings, env_reward  # noqa: E402
from rollout_lib.model.chat import encode_prompt, use_chat_template  # noqa: E402
from rollout_lib.model.loading import load_tokenizer, resolve_model  # noqa: E402
from rollout_lib.plan import describe_plan  # noqa: E402
from rollout_lib.reward.loop import RewardLoop  # noqa: E402
from rollout_lib.reward.tables import reward_inputs  # noqa: E402
from rollout_lib.rl.sample import openenv_metrics  # noqa: E402
from rollout_lib.sampling import SamplingParams  # noqa: E402
from rollout_lib.sampling.base import sample_episodes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "rl-openenv-tiny.toml"
ENVIRONMENT = "examples.openenv_guess.environment:GuessEnvironment"
OPENING = 'Guess my number from 1 to 8. Answer with JSON: {"guess": <number>}.'
QUESTION = [{"role": "user", "content": "Play."}]
STEP_SEED = 7


class GuessServer:
    """examples/openenv_guess/server.py under uvicorn, as a user starts it; restarted by `ensure` once killed."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.url = ""

    def ensure(self) -> "GuessServer":
        if self.process is not None and self.process.poll() is None:
            return self
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "examples.openenv_guess.server:app", "--host", "127.0.0.1", "--port",
             str(port), "--log-level", "warning"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "the OpenEnv example server exited at start-up"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError(f"the OpenEnv example server did not answer at {self.url}")

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture(scope="module")
def server():
    guess = GuessServer()
    try:
        yield guess.ensure()
    finally:
        if guess.process is not None and guess.process.poll() is None:
            guess.kill()


@pytest.fixture(scope="module")
def tokenizer():
    return use_chat_template(load_tokenizer(resolve_model("tiny:qwen2")),
                             str(ROOT / "configs/templates/chatml-tools.jinja"))


def char_ids(tokenizer, text: str) -> list[int]:
    return [token for char in text for token in tokenizer(char, add_special_tokens=False)["input_ids"]]


def scripted(tokenizer, turns: list[str], before_turn=None):
    """A generate function whose k-th model turn in a sequence is turns[k]; `before_turn(k)` runs first."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(sequences, params, seed):
        k = tokenizer.decode(sequences[0]).count("<|im_start|>assistant") - 1
        if before_turn is not None:
            before_turn(k)
        ids = char_ids(tokenizer, turns[k]) + [end]
        return [(list(ids), [-0.5] * len(ids)) for _ in sequences]

    return generate


def secret(example_id: str = "g0", seed: int = STEP_SEED) -> int:
    """The number the example env draws at reset: random.Random(seed).randint(1, 8), the seed derived by the
    driver from the step's seed and the example (envs/episodes.py)."""
    return random.Random(derived_seed("episode-begin", seed, example_id)).randint(1, 8)


def episodes(tokenizer, turns: list[str], group_size: int = 2, before_turn=None, **settings) -> list[dict]:
    interaction = build_interaction(OpenEnvSettings(**{"observation_field": "feedback", "max_turns": 4, **settings}))
    table = pa.Table.from_pylist([{"example_id": "g0", "env": "guess", "messages": QUESTION, "answer": None,
                                   "info": None, "source_line": 1}], schema=wire.PROMPTS)
    prompt_ids = [encode_prompt(tokenizer, QUESTION, interaction.tool_schemas)]
    rollouts = sample_episodes(scripted(tokenizer, turns, before_turn), tokenizer, interaction, table, prompt_ids,
                               SamplingParams(group_size=group_size, max_tokens=64), STEP_SEED,
                               [tokenizer.convert_tokens_to_ids("<|im_end|>")], 1024)
    return rollouts.to_pylist()


def scores(rows: list[dict]):
    with RewardLoop([(env_reward, 1.0)], concurrency=2, timeout_s=10) as loop:
        return loop.score(reward_inputs(pa.Table.from_pylist(rows, schema=wire.ROLLOUTS)))


def record(row: dict) -> dict:
    return json.loads(row["episode"])


JSON_TURNS = ["I am not sure.", '{"guess": "five"}', f'Then {{"guess": {secret()}}}']


def test_in_process_episodes_reset_from_the_derived_seed_and_step_json_actions(tokenizer):
    rows = episodes(tokenizer, JSON_TURNS, environment=ENVIRONMENT)
    assert len(rows) == 2
    for row in rows:  # both episodes of the group play the same draw
        # The reset observation is the first message the model reads: the prompt, rendered with it.
        assert row["prompt_ids"] == encode_prompt(tokenizer, QUESTION + [{"role": "user", "content": OPENING}])
        turns = row["completion_turns"]
        assert [(turn["role"], turn["sampled"]) for turn in turns] == [
            ("assistant", True), ("user", False), ("assistant", True), ("user", False), ("assistant", True)]
        assert turns[1]["content"] == "error: no action: write one JSON object, the action"
        assert turns[3]["content"].startswith("error: invalid action: guess: Input should be a valid integer")
        assert record(row)["end"] == "env" and record(row)["turns"] == 3
        assert record(row)["state"] == {"env_reward": 1.0, "steps": 1, "action_errors": 2,
                                        "observation": {"feedback": "correct"}}
    assert [result.reward for result in scores(rows)] == [1.0, 1.0]
    assert openenv_metrics([record(row) for row in rows]) == {"env_failures": 0, "env_steps_mean": 1.0,
                                                              "env_action_errors_mean": 2.0}


def test_a_wrong_guess_is_answered_by_the_observation_and_a_rerun_replays(tokenizer):
    wrong = 8 if secret() < 8 else 1
    turns = [f'{{"guess": {wrong}}}', f'{{"guess": {secret()}}}']
    first = episodes(tokenizer, turns, group_size=1, environment=ENVIRONMENT)
    assert first[0]["completion_turns"][1]["content"] == ("lower" if wrong > secret() else "higher")
    assert record(first[0])["state"]["steps"] == 2 and record(first[0])["state"]["env_reward"] == 1.0
    assert episodes(tokenizer, turns, group_size=1, environment=ENVIRONMENT) == first


@pytest.mark.slow  # starts the example's env server
def test_served_episodes_are_the_in_process_episodes(tokenizer, server):
    wrong = 8 if secret() < 8 else 1
    turns = ["I am not sure.", f'{{"guess": {wrong}}}', f'{{"guess": {secret()}}}']
    in_process = episodes(tokenizer, turns, environment=ENVIRONMENT)
    served = episodes(tokenizer, turns, url=server.ensure().url)
    assert [(row["prompt_ids"], row["completion_ids"], row["episode"]) for row in served] == \
        [(row["prompt_ids"], row["completion_ids"], row["episode"]) for row in in_process]
    assert record(served[0])["state"]["env_reward"] == 1.0 and record(served[0])["state"]["steps"] == 2
    # Every session closed with its episode, and with the last one the sessions' event-loop thread stopped.
    assert not [thread for thread in threading.enumerate() if thread.name == "openenv-sessions"]
    # A refused action is the model's to read there too, in fewer words (the client does not pass pydantic's on).
    [refused] = episodes(tokenizer, JSON_TURNS, group_size=1, url=server.url)
    assert refused["completion_turns"][3]["content"] == \
        "error: invalid action: the environment refused it (it does not match the action's schema)"
    assert record(refused)["state"]["action_errors"] == 2 and record(refused)["state"]["env_reward"] == 1.0


def test_tool_call_actions_are_tool_messages_with_their_call_ids(tokenizer):
    call = '<tool_call>\n{{"name": "{name}", "arguments": {{"guess": {guess}}}}}\n</tool_call>'
    wrong = 8 if secret() < 8 else 1
    turns = [call.format(name="step", guess=wrong), call.format(name="guess", guess=1),
             call.format(name="step", guess=secret())]
    [row] = episodes(tokenizer, turns, group_size=1, environment=ENVIRONMENT, action="tool_call")
    assert '"name": "step"' in tokenizer.decode(row["prompt_ids"])  # the action's schema, shown as a tool
    replies = [turn for turn in row["completion_turns"] if not turn["sampled"]]
    assert [(turn["role"], turn["content"]) for turn in replies] == [
        ("tool", "lower" if wrong > secret() else "higher"),
        ("tool", "error: unknown tool 'guess'; the action is the tool 'step'")]
    state = record(row)["state"]
    assert state["steps"] == 2 and state["action_errors"] == 1 and state["env_reward"] == 1.0
    assert record(row)["tool_calls"] == 2 and record(row)["tool_errors"] == 1


@pytest.mark.slow  # starts the example's env server
def test_a_served_env_killed_mid_step_fails_that_group_naming_the_url(tokenizer, server, caplog):
    url = server.ensure().url

    def kill_before_the_second_turn(k: int) -> None:
        if k == 1:
            server.kill()

    wrong = 8 if secret() < 8 else 1
    turns = [f'{{"guess": {wrong}}}', f'{{"guess": {secret()}}}']
    with caplog.at_level(logging.WARNING, logger="rollout_lib.envs.openenv_env"):
        rows = episodes(tokenizer, turns, before_turn=kill_before_the_second_turn, url=url)
    for row in rows:  # the first step was answered; the second found the server gone
        error = record(row)["state"]["episode_error"]
        assert error.startswith(f"OpenEnv server {url}: step failed, the connection is lost")
        assert record(row)["state"]["steps"] == 1 and record(row)["end"] == "env"
    # By the reward loop's rules: missing (None with the reason), never 0; the breaker decides about the step.
    results = scores(rows)
    assert [result.reward for result in results] == [None, None]
    assert all(result.error == f"episode failed: {record(rows[0])['state']['episode_error']}" for result in results)
    lines = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    assert len(lines) == 2 and all("(example 'g0'): the episode fails, its reward is missing" in line
                                   for line in lines)
    assert openenv_metrics([record(row) for row in rows])["env_failures"] == 2
    # A step that starts with the server gone fails at once, naming the URL (the next user restarts it).
    with pytest.raises(ValueError, match=f"^OpenEnv server {url}: GET /schema failed .*is the env server running"):
        build_interaction(OpenEnvSettings(url=url))


def test_an_environment_that_raises_fails_its_episode_not_the_step(tokenizer):
    # An empty range: the example env's reset raises (random.randint(9, 1)).
    [row] = episodes(tokenizer, ["{}"], group_size=1, environment=ENVIRONMENT, kwargs={"low": 9, "high": 1})
    assert row["prompt_ids"] == encode_prompt(tokenizer, QUESTION)  # no observation to show
    assert record(row)["state"]["episode_error"].startswith(
        f"OpenEnv environment {ENVIRONMENT}: reset raised ValueError: empty range")
    assert record(row)["turns"] == 1 and [result.reward for result in scores([row])] == [None]


from examples.openenv_guess.environment import GuessEnvironment  # noqa: E402


class HangsOnZero(GuessEnvironment):
    """The example env, but a guess of 0 hangs its step (until the test releases it)."""

    release = threading.Event()

    def step(self, action, timeout_s=None, **kwargs):
        if action.guess == 0:
            self.release.wait(60)
        return super().step(action, timeout_s, **kwargs)


def test_an_in_process_environment_that_hangs_fails_its_episode_at_timeout_s_not_the_step(tokenizer):
    settings = {"group_size": 1, "environment": "test_openenv:HangsOnZero", "timeout_s": 0.5}
    started = time.monotonic()
    try:
        [hung] = episodes(tokenizer, ['{"guess": 0}', f'{{"guess": {secret()}}}'], **settings)
        [played] = episodes(tokenizer, [f'{{"guess": {secret()}}}'], **settings)
    finally:
        HangsOnZero.release.set()
    assert time.monotonic() - started < 20  # not the hang's 60 s
    assert record(hung)["state"]["episode_error"] == (
        "OpenEnv environment test_openenv:HangsOnZero: step did not return within 0.5s (interaction.timeout_s)")
    assert record(hung)["turns"] == 1 and [result.reward for result in scores([hung])] == [None]
    assert record(played)["state"]["env_reward"] == 1.0  # the same class, a step that returns: unaffected


class SlowSteps(GuessEnvironment):
    """The example env, each step 0.3 s (waiting, as on a server), counting the steps in flight at once."""

    lock, in_flight, most = threading.Lock(), 0, 0

    def step(self, action, timeout_s=None, **kwargs):
        with self.lock:
            SlowSteps.in_flight += 1
            SlowSteps.most = max(SlowSteps.most, SlowSteps.in_flight)
        time.sleep(0.3)
        with self.lock:
            SlowSteps.in_flight -= 1
        return super().step(action, timeout_s, **kwargs)


def test_a_turns_environment_steps_run_at_once_and_the_episodes_are_the_same_as_one_by_one(tokenizer, monkeypatch):
    turns = ['{"guess": 9}', f'{{"guess": {secret()}}}']
    concurrent = episodes(tokenizer, turns, group_size=4, environment="test_openenv:SlowSteps")
    assert SlowSteps.most == 4  # the group's four steps of a turn were in flight together
    monkeypatch.setattr(OpenEnvInteraction, "concurrent_replies", False)
    SlowSteps.most = 0
    assert episodes(tokenizer, turns, group_size=4, environment="test_openenv:SlowSteps") == concurrent
    assert SlowSteps.most == 1


def test_a_class_that_is_not_an_openenv_environment_is_refused_naming_it():
    with pytest.raises(TypeError, match="'rollout_lib.envs.guess_number:GuessNumber' is not a subclass of openenv"):
        build_interaction(OpenEnvSettings(environment="rollout_lib.envs.guess_number:GuessNumber"))


def test_settings_are_checked_at_plan_time_without_importing_the_env():
    with pytest.raises(ValueError, match="names either `environment`"):
        OpenEnvSettings(environment=ENVIRONMENT, url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="names either `environment`"):
        OpenEnvSettings()
    with pytest.raises(ValueError, match="OpenEnv environment class 'examples.openenv_guess.environment:Missing'"):
        OpenEnvSettings(environment="examples.openenv_guess.environment:Missing")
    with pytest.raises(ValueError, match="url 'ws://x'"):
        OpenEnvSettings(url="ws://x")
    # The tiny model's own template renders no tools: a tool_call action is refused before anything runs, naming
    # the setting; the tool-rendering template in algorithm.rl.chat_template passes.
    tool_call = 'algorithm.rl.envs[0].interaction.action="tool_call"'
    with pytest.raises(ConfigError, match=r"algorithm.rl.envs\[0\].interaction.action: the policy's chat template"):
        describe_plan(load_config(RlConfig, ROOT / "configs" / CONFIG, [tool_call]))
    describe_plan(load_config(RlConfig, ROOT / "configs" / CONFIG,
                              [tool_call, 'algorithm.rl.chat_template="configs/templates/chatml-tools.jinja"']))


def test_without_the_package_the_plan_stops_in_one_line_naming_the_extra():
    # openenv blocked in this interpreter only (a None entry in sys.modules is how Python spells "not installed").
    code = ("import sys, runpy; sys.modules['openenv'] = None; "
            f"sys.argv = ['rollout', 'train', 'rl', '--config', 'configs/{CONFIG}', '--dry-run']; "
            "runpy.run_module('rollout_cli', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [f"rollout: error: configs/{CONFIG}: algorithm.rl.envs[0].interaction: OpenEnv environments "
                     "need openenv-core, which is not installed: pip install -e '.[openenv]' (or, keeping pillow 13: "
                     "pip install --no-deps openenv-core==0.3.0 fastmcp==4.2.3, as scripts/setup.sh --test does)"]


@pytest.mark.slow  # starts the example's env server; trains two steps twice
def test_two_steps_in_process_and_served_sample_the_same_episodes(server):
    from inprocess_rl import reward_curve_in_process

    curve, in_process = reward_curve_in_process(CONFIG, [], 2)
    interaction = f'{{type="openenv",url="{server.ensure().url}",observation_field="feedback",max_turns=3}}'
    served_curve, served = reward_curve_in_process(CONFIG, [f"algorithm.rl.envs[0].interaction={interaction}"], 2)
    assert len(curve) == 2 and served_curve == curve
    assert in_process.num_rows == 4
    tokenizer = load_tokenizer(resolve_model("tiny:qwen2"))
    for a, b in zip(in_process.to_pylist(), served.to_pylist()):
        # Every episode was reset (its observation is the prompt's last message) and scored through env_reward.
        assert tokenizer.decode(a["prompt_ids"]).endswith(f"<|im_start|>user\n{OPENING}<|im_end|>\n"
                                                          "<|im_start|>assistant\n")
        assert a["reward"] is not None and a["reward_error"] is None
        assert (a["prompt_ids"], a["completion_ids"], a["reward"]) == (b["prompt_ids"], b["completion_ids"],
                                                                       b["reward"])
