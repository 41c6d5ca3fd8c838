"""A user's GenRM reward file written for verl's reward loop, as seed 004 shows it: `compute_score_gsm8k` formats a
prompt, POSTs it to `reward_router_address` with a `chat_complete` helper of its own (aiohttp, as verl's recipes
do), and reads the last paragraph of the verdict as an int. Nothing in it knows rollout; its text is the seed's
(it asks for up to 4096 tokens, which a judge must admit: tests/test_judge_rewards.py serves one that does). The
short-verdict copy asks for 16, for the session's tiny judge (1024 tokens of context, which refuses 4096). The sync
twin does the same with `requests`, as a sync verl function run in an executor would.

Used by tests/test_judge_rewards.py and tests/test_reward_router.py as "example_genrm_rewards:<name>".
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import TYPE_CHECKING

import aiohttp
import requests

if TYPE_CHECKING:  # the seed's annotation; transformers is not imported at run time
    from transformers import PreTrainedTokenizer

GRM_PROMPT_TEMPLATE = """You are a strict math teacher. Check the solution to the problem.

Problem: {problem}

Solution: {solution}

Reason briefly, then give your verdict as the last paragraph: 1 if the solution is correct, 0 if not."""


def _as_object(payload: str):
    # `result.choices[0].message.content`, as the seed reads the reply (an openai ChatCompletion there)
    return json.loads(payload, object_hook=lambda fields: SimpleNamespace(**fields))


async def chat_complete(router_address: str, chat_complete_request: dict):
    """POST one OpenAI chat completion request to the router; raise on an error status."""
    url = f"http://{router_address}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=chat_complete_request) as response:
            text = await response.text()
            if response.status != 200:
                raise RuntimeError(f"chat_complete: HTTP {response.status}: {text}")
            return _as_object(text)


async def compute_score_gsm8k(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict,
    reward_router_address: str,
    reward_model_tokenizer: PreTrainedTokenizer,
):
    """Compute the reward score."""
    # Step 1: Prepare prompt and request payload
    grm_prompt = GRM_PROMPT_TEMPLATE.format(problem=extra_info["question"], solution=solution_str)
    messages = [{"role": "user", "content": grm_prompt}]
    sampling_params = {"temperature": 0.7, "top_p": 0.8, "max_tokens": 4096}
    chat_complete_request = {"messages": messages, **sampling_params}

    # Step 2: Send async request to the reward model
    # here, chat_complete sends async http request to the router address
    result = await chat_complete(
        router_address=reward_router_address,
        chat_complete_request=chat_complete_request,
    )

    # Step 3: Parse model response and extract score
    grm_response = result.choices[0].message.content.strip()
    try:
        score_str = grm_response.split("\n\n")[-1].strip()
        score = int(score_str)
    except Exception:
        score = 0
    return {"score": score}


async def compute_score_gsm8k_short_verdict(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                                            reward_model_tokenizer):
    """The seed's compute_score_gsm8k asking for a verdict of at most 16 tokens (a judge of 1024 tokens of context
    refuses max_tokens 4096)."""
    grm_prompt = GRM_PROMPT_TEMPLATE.format(problem=extra_info["question"], solution=solution_str)
    request = {"messages": [{"role": "user", "content": grm_prompt}], "temperature": 0.7, "top_p": 0.8,
               "max_tokens": 16}
    grm_response = (await chat_complete(reward_router_address, request)).choices[0].message.content.strip()
    try:
        score = int(grm_response.split("\n\n")[-1].strip())
    except Exception:
        score = 0
    return {"score": score}


def compute_score_gsm8k_sync(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                             reward_model_tokenizer):
    """The same, sync (run in a worker process), and it counts the prompt's tokens with the judge's tokenizer."""
    grm_prompt = GRM_PROMPT_TEMPLATE.format(problem=extra_info["question"], solution=solution_str)
    request = {"messages": [{"role": "user", "content": grm_prompt}], "temperature": 0.7, "top_p": 0.8,
               "max_tokens": 16}
    response = requests.post(f"http://{reward_router_address}/v1/chat/completions", json=request, timeout=120)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
    grm_response = _as_object(response.text).choices[0].message.content.strip()
    try:
        score = int(grm_response.split("\n\n")[-1].strip())
    except Exception:
        score = 0
    if not reward_model_tokenizer(grm_prompt)["input_ids"]:
        raise ValueError("the judge's tokenizer made nothing of the prompt")
    return {"score": score}


async def asks_with_a_bad_request(data_source, solution_str, ground_truth, reward_router_address):
    """A function whose request the judge refuses (max_tokens < 1): its error comes back through the router."""
    return await chat_complete(reward_router_address, {"messages": [{"role": "user", "content": solution_str}],
                                                       "max_tokens": -1})


def sync_judged(inp, *, judge, bonus=0.0):
    """Ours (one RewardInput), sync, asking the judge through the client it is handed (in a worker process)."""
    verdict = judge.chat([{"role": "user", "content": "Rate: " + inp.completion_text}], seed=1)
    return min(1.0, len(verdict) / 100) + bonus


def compute_score_disrm(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
    """A discriminative reward model's raw score of (question, solution) through the router: the pair encoded by the
    reward model's own tokenizer, POST /classify (vLLM's pooling runner; no sigmoid)."""
    ids = reward_model_tokenizer(extra_info["question"], solution_str)["input_ids"]
    response = requests.post(f"http://{reward_router_address}/classify",
                             json={"input": [ids], "use_activation": False}, timeout=120)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
    return float(response.json()["data"][0]["probs"][0])
