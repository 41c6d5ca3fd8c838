"""Multi-turn episodes on the wire: the env's reply is rendered by the policy's chat template token-exactly, every
completion token is attributed (sampled by the policy, or written by the env under a role), sampling logprobs exist
only on sampled tokens, env tokens never enter rl, and echo puts its role's alpha on env message bodies only.

The policy in the driver tests is scripted (a generate function writing fixed turns through the real tiny
tokenizer), so the expected token sequence is known exactly; the sampler test runs the real transformers sampler."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pytest
import torch

from rollout_lib import wire
from rollout_lib.algo.echo import Echo, EchoSettings, trajectory_steps
from rollout_lib.algo.grpo import Grpo, GrpoSettings
from rollout_lib.algo.stamping import assign_advantages, score_for_shipping, stamp_training_samples
from rollout_lib.envs import EnvReply, build_interaction
from rollout_lib.envs.calculator import CalculatorSettings
from rollout_lib.envs.render import render_env_reply
from rollout_lib.losses import _component_masks
from rollout_lib.model.loading import load_causal_lm, load_tokenizer, resolve_model
from rollout_lib.packing import collate_micro_batch, pack_samples
from rollout_lib.reward.functions import env_score
from rollout_lib.reward.tables import reward_inputs
from rollout_lib.sampling import SamplingParams
from rollout_lib.sampling.base import encode_prompt, sample_episodes
from rollout_lib.sampling.hf import HfSampler, HfSamplerSettings

QUESTION = [{"role": "user", "content": "What is 37 * 24?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("tiny:qwen2"))


def scripted_policy(tokenizer, turns: list[str]):
    """A generate function whose k-th turn (counted per sequence from the env replies in it) is turns[k]."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(sequences, params, seed):
        outputs = []
        for sequence in sequences:
            k = tokenizer.decode(sequence).count("<|im_start|>assistant") - 1
            ids = tokenizer(turns[k], add_special_tokens=False)["input_ids"] + [end]
            outputs.append((ids, [-0.5 - 0.01 * i for i in range(len(ids))]))
        return outputs

    return generate


def prompts_table(n: int = 1) -> pa.Table:
    return pa.Table.from_pylist([{"example_id": f"q{i}", "env": "calc", "messages": QUESTION, "answer": "888",
                                  "info": None, "source_line": i + 1} for i in range(n)], schema=wire.PROMPTS)


def calculator_episodes(tokenizer, turns: list[str], group_size: int = 2, max_turns: int = 3) -> pa.Table:
    prompt_ids = [encode_prompt(tokenizer, QUESTION)]
    return sample_episodes(scripted_policy(tokenizer, turns), tokenizer,
                           build_interaction(CalculatorSettings(max_turns=max_turns)), prompts_table(),
                           prompt_ids, SamplingParams(group_size=group_size, max_tokens=16), seed=0,
                           stop_ids=[tokenizer.eos_token_id], context_limit=256)


def test_an_episode_is_the_chat_template_rendering_of_its_conversation(tokenizer):
    row = calculator_episodes(tokenizer, ["calc: 37 * 24", "The answer is 888."]).to_pylist()[0]
    conversation = [*QUESTION, {"role": "assistant", "content": "calc: 37 * 24"}, {"role": "tool", "content": "888"},
                    {"role": "assistant", "content": "The answer is 888."}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    # Token-exact: the model's turns as sampled, the env's reply as the template renders it (the rendering's trailing
    # newline follows the last end-of-turn token, which the model does not write).
    assert tokenizer.decode(row["prompt_ids"] + row["completion_ids"]) == rendered.removesuffix("\n")
    assert row["prompt_ids"] + row["completion_ids"] == tokenizer(rendered.removesuffix("\n"))["input_ids"]

    turns = row["completion_turns"]
    assert [(t["role"], t["sampled"]) for t in turns] == [("assistant", True), ("tool", False), ("assistant", True)]
    position = 0
    for turn in turns:  # the segments tile the completion
        assert turn["start"] == position
        position += turn["length"]
    assert position == len(row["completion_ids"])

    def text(start, length):
        return tokenizer.decode(row["completion_ids"][start:start + length])

    tool = turns[1]
    assert text(tool["start"], tool["length"]) == "\n<|im_start|>tool\n888<|im_end|>\n<|im_start|>assistant\n"
    assert text(tool["body_start"], tool["body_length"]) == "888" and tool["content"] == "888"
    assert text(turns[2]["start"], turns[2]["length"]) == "The answer is 888.<|im_end|>"
    # Sampling logprobs on the sampled tokens only.
    logprobs = row["sampling_logprobs"]
    assert all((lp is None) == (tool["start"] <= i < tool["start"] + tool["length"]) for i, lp in enumerate(logprobs))
    assert json.loads(row["episode"]) == {"end": "env", "turns": 2,
                                          "state": {"answer": "888", "calls": 1, "results": ["888"], "score": 1.0}}


def test_episodes_end_at_max_turns_and_on_a_cut_turn(tokenizer):
    looping = calculator_episodes(tokenizer, ["calc: 1 + 1"] * 3, max_turns=2).to_pylist()[0]
    assert json.loads(looping["episode"])["end"] == "max_turns"
    assert [t["sampled"] for t in looping["completion_turns"]] == [True, False, True]  # no reply to the last turn

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def cut(sequences, params, seed):  # a turn that fills max_tokens without the stop token
        return [([5] * params.max_tokens, [-1.0] * params.max_tokens) for _ in sequences]

    table = sample_episodes(cut, tokenizer, build_interaction(CalculatorSettings()), prompts_table(),
                            [encode_prompt(tokenizer, QUESTION)], SamplingParams(group_size=1, max_tokens=4), 0,
                            [end], 256)
    row = table.to_pylist()[0]
    assert json.loads(row["episode"])["end"] == "truncated" and row["completion_ids"] == [5, 5, 5, 5]


def test_a_reply_renders_without_a_chat_template_as_lines(tokenizer):
    plain = load_tokenizer(resolve_model("tiny:qwen2"))
    plain.chat_template = None
    ids, [message] = render_env_reply(plain, [*QUESTION, {"role": "assistant", "content": "x"}], plain.eos_token_id,
                                      [{"role": "user", "content": "higher"}])
    assert plain.decode(ids) == "higher\n"
    assert plain.decode(ids[message.body_start:message.body_end]) == "higher"


def test_env_tokens_never_train_rl_and_echo_trains_tool_bodies_at_alpha(tokenizer):
    rollouts = calculator_episodes(tokenizer, ["calc: 37 * 24", "The answer is 888."])
    rollouts = rollouts.set_column(rollouts.schema.get_field_index("reward"), wire.ROLLOUTS.field("reward"),
                                   pa.array([1.0, 0.0], pa.float64()))
    row = rollouts.to_pylist()[0]
    n_prompt, tool = len(row["prompt_ids"]), row["completion_turns"][1]
    env_positions = set(range(n_prompt + tool["start"], n_prompt + tool["start"] + tool["length"]))
    body = set(range(n_prompt + tool["body_start"], n_prompt + tool["body_start"] + tool["body_length"]))

    for algorithm in (Grpo(GrpoSettings(), where="algorithm.rl.envs[0].algo"),
                      Echo(EchoSettings(), where="algorithm.rl.envs[0].algo")):
        algorithms = {"calc": algorithm}
        samples = stamp_training_samples(rollouts, assign_advantages(rollouts, algorithms), algorithms, 256,
                                         {"calc": 0.7})
        samples = asyncio.run(score_for_shipping(samples, algorithms))
        [mb] = pack_samples(samples, 512).to_pylist()
        streams = collate_micro_batch(mb, packed=True, pad_token_id=0)
        masks = _component_masks(streams)
        length = len(row["prompt_ids"]) + len(row["completion_ids"])
        rl = [i for i in range(length) if masks["rl"][i]]
        # rl: exactly the policy's sampled tokens of sample 0 (its advantage +0.5), never an env token.
        assert rl == [i for i in range(n_prompt, length) if i not in env_positions]
        assert all(mb["advantages"][i] == 0.0 for i in env_positions)
        assert mb["temperatures"][:length] == [pytest.approx(0.7 if i in rl else 1.0) for i in range(length)]
        ce = {i: mb["ce_weights"][i] for i in range(length) if mb["ce_weights"][i]}
        if isinstance(algorithm, Echo):
            assert ce == {i: pytest.approx(0.1) for i in body}  # the tool's body at 0.1, never its framing
        else:
            assert ce == {}


def test_echo_role_table_and_filter(tokenizer, tmp_path, monkeypatch):
    rollouts = calculator_episodes(tokenizer, ["calc: 37 * 24", "The answer is 888."])
    row = rollouts.to_pylist()[0]
    n_prompt, tool, answer = len(row["prompt_ids"]), row["completion_turns"][1], row["completion_turns"][2]
    assert Echo(EchoSettings(roles={"user": {"alpha": 1.0}})).observation_weights(row) == [0.0] * len(
        row["completion_ids"])  # setting roles replaces the table: tool bodies no longer train

    (tmp_path / "echo_filters.py").write_text(
        "def keep_first(rollout, keep_first=0):\n"  # step k's mask over its prompt_ids + completion_ids
        "    n = len(rollout['prompt_ids'])\n"
        "    return [[i < n + keep_first for i in range(n + s['completion_end'])]\n"
        "            for s in rollout['trajectory_steps']]\n"
        "def one_flat_mask(rollout):\n"  # the old contract: one bool per completion token
        "    return [True] * len(rollout['completion_ids'])\n"
        "def short_last_step(rollout):\n"
        "    return [[True] * (s['prompt_len'] + s['completion_end'] - s['completion_start'] - i)\n"
        "            for i, s in enumerate(rollout['trajectory_steps'])]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    keep_all = Echo(EchoSettings(filter={"import_path": "echo_filters:keep_first",
                                         "kwargs": {"keep_first": tool["body_start"] + 1}}))
    weights = keep_all.observation_weights(row)
    assert [i for i, w in enumerate(weights) if w] == [tool["body_start"]]  # the filter kept the first body token
    assert trajectory_steps(row) == [  # two model calls: the second was given the tool's reply in its prompt
        {"prompt_len": n_prompt, "completion_start": 0, "completion_end": tool["start"]},
        {"prompt_len": n_prompt + answer["start"], "completion_start": answer["start"],
         "completion_end": answer["start"] + answer["length"]}]
    lengths = [n_prompt + tool["start"], n_prompt + len(row["completion_ids"])]
    for name, got in (("one_flat_mask", rf"{len(row['completion_ids'])} entries, not all lists of bools"),
                      ("short_last_step", rf"2 keep-masks of lengths \[{lengths[0]}, {lengths[1] - 1}\]")):
        broken = Echo(EchoSettings(filter={"import_path": f"echo_filters:{name}"}), where="algorithm.rl.envs[0].algo")
        with pytest.raises(ValueError, match=rf"^algorithm.rl.envs\[0\].algo.filter: echo filter "
                                             rf"'echo_filters:{name}' returned {got} for sample 'q0#0'; expected 2 "
                                             rf"keep-masks \(one per trajectory step, each over its prompt_ids \+ "
                                             rf"completion_ids\) of lengths \[{lengths[0]}, {lengths[1]}\]$"):
            broken.observation_weights(row)


def test_echo_filter_an_env_token_is_decided_by_the_first_step_shown_it(tokenizer, tmp_path, monkeypatch):
    """Three model calls, two tool replies: reply j is first in step j+1's prompt, and that step's mask decides it;
    later steps' masks over it are not read, nor entries on the row's prompt or on sampled tokens."""
    rollouts = calculator_episodes(tokenizer, ["calc: 1 + 1", "calc: 2 + 2", "The answer is 4."], group_size=1)
    row = rollouts.to_pylist()[0]
    n_prompt, turns = len(row["prompt_ids"]), row["completion_turns"]
    assert [(t["role"], t["sampled"]) for t in turns] == [("assistant", True), ("tool", False), ("assistant", True),
                                                           ("tool", False), ("assistant", True)]
    first, second = turns[1], turns[3]
    bodies = [list(range(t["body_start"], t["body_start"] + t["body_length"])) for t in (first, second)]
    default = Echo(EchoSettings()).observation_weights(row)
    assert [i for i, w in enumerate(default) if w] == bodies[0] + bodies[1]

    (tmp_path / "step_filters.py").write_text(
        "SEEN = []\n"
        "def drop(rollout, drops):\n"  # drops: [step, completion position] pairs set False in that step's mask
        "    SEEN.append(rollout['trajectory_steps'])\n"
        "    n = len(rollout['prompt_ids'])\n"
        "    masks = [[True] * (s['prompt_len'] + s['completion_end'] - s['completion_start'])\n"
        "             for s in rollout['trajectory_steps']]\n"
        "    for step, position in drops:\n"
        "        masks[step][n + position] = False\n"
        "    return masks\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import step_filters

    def kept(drops):
        echo = Echo(EchoSettings(filter={"import_path": "step_filters:drop", "kwargs": {"drops": drops}}))
        return [i for i, w in enumerate(echo.observation_weights(row)) if w]

    # The first reply's last body token dropped through step 1's prompt (the step it was first shown to): gone.
    assert kept([[1, bodies[0][-1]]]) == bodies[0][:-1] + bodies[1]
    assert len(step_filters.SEEN[-1]) == 3 and step_filters.SEEN[-1][1]["prompt_len"] == n_prompt + turns[2]["start"]
    # Step 2's prompt holds the first reply too, but step 1 decided it: step 2's mask drops only the second reply.
    assert kept([[2, bodies[0][0]], [2, bodies[1][0]]]) == bodies[0] + bodies[1][1:]
    # Entries on the row's prompt and on sampled tokens are not read (neither trains ce).
    assert kept([[0, 0], [2, turns[2]["start"]]]) == bodies[0] + bodies[1]
    # A reply after the last model call (an episode stopped at the context limit) is in no step's prompt: dropped.
    cut = dict(row, completion_ids=row["completion_ids"][:turns[4]["start"]], completion_turns=turns[:4],
               sampling_logprobs=row["sampling_logprobs"][:turns[4]["start"]])
    echo = Echo(EchoSettings(filter={"import_path": "step_filters:drop", "kwargs": {"drops": []}}))
    assert [i for i, w in enumerate(echo.observation_weights(cut)) if w] == bodies[0]
    # A single-turn rollout is one step over its whole prompt + completion.
    single = dict(row, completion_turns=None)
    assert trajectory_steps(single) == [{"prompt_len": n_prompt, "completion_start": 0,
                                         "completion_end": len(row["completion_ids"])}]


def test_reward_functions_read_the_last_turn_and_the_episode_state(tokenizer):
    rollouts = calculator_episodes(tokenizer, ["calc: 37 * 24", "The answer is 888."])
    [first, _] = reward_inputs(rollouts, prompts_table())
    assert first.completion_text == "The answer is 888."
    assert [t["role"] for t in first.turns] == ["assistant", "tool", "assistant"]
    assert env_score(first) == 1.0
    wrong = calculator_episodes(tokenizer, ["calc: 37 * 24", "The answer is 37."])
    assert env_score(reward_inputs(wrong)[0]) == 0.0


def test_the_transformers_sampler_plays_episodes_reproducibly(tokenizer):
    model = load_causal_lm(resolve_model("tiny:qwen2"))
    sampler = HfSampler(HfSamplerSettings(), model, tokenizer)
    params = SamplingParams(group_size=4, max_tokens=6)
    interaction = build_interaction(CalculatorSettings())
    first = sampler.sample(prompts_table(2), params, 7, interaction=interaction, context_limit=128)
    again = sampler.sample(prompts_table(2), params, 7, interaction=interaction, context_limit=128)
    assert first.equals(again) and first.num_rows == 8
    for row in first.to_pylist():
        assert len(row["sampling_logprobs"]) == len(row["completion_ids"])
        sampled = [i for t in row["completion_turns"] if t["sampled"] for i in range(t["start"], t["start"] + t["length"])]
        assert all(row["sampling_logprobs"][i] is not None and row["sampling_logprobs"][i] <= 0 for i in sampled)
    torch.manual_seed(0)  # the sampler forks the RNG: the caller's state is untouched either way


def test_an_interaction_must_reply_with_an_env_reply():
    with pytest.raises(ValueError, match="ends the episode writes no messages"):
        EnvReply(messages=[{"role": "user", "content": "x"}], done=True)
    with pytest.raises(ValueError, match="at least one message"):
        EnvReply()


def test_an_interaction_that_fails_names_the_env_the_example_and_its_line(tmp_path, monkeypatch):
    from rollout_lib.config import RlConfig
    from rollout_lib.plan_checks import validate_config
    from rollout_lib.config.loading import read_toml
    from rollout_lib.envs.episodes import EpisodeError
    from rollout_lib.rl.prompts import load_prompts
    from rollout_lib.rl.sample import build_samplers, sample_rollouts

    (tmp_path / "exploding_env.py").write_text(
        "class Exploding:\n"
        "    def start(self, prompt):\n"
        "        if 'sea' in prompt['messages'][-1]['content']:\n"
        "            raise RuntimeError('no seas here')\n"
        "        return {}\n"
        "    def respond(self, state, messages):\n"
        "        raise AssertionError('never reached')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = read_toml("configs/rl-tiny.toml")
    raw["algorithm"]["rl"]["envs"][0].update(
        prompts_per_step=8, interaction={"type": "custom", "import_path": "exploding_env:Exploding"})
    config = validate_config(RlConfig, raw)
    prompts = {"words": load_prompts(config.settings.envs[0])}
    model = load_causal_lm(resolve_model("tiny:qwen2"))
    samplers = build_samplers(config, model, load_tokenizer(resolve_model("tiny:qwen2")))
    with pytest.raises(EpisodeError) as failure:
        sample_rollouts(config, samplers, prompts, step=1)
    assert str(failure.value).startswith("algorithm.rl.envs[0].interaction: Exploding.start failed on example ")
    assert "(line 3): RuntimeError: no seas here" in str(failure.value)
