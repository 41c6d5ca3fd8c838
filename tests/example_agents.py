"""Agents for configs/rl-agent-tiny.toml and tests/test_agents.py. A user's agent looks like `calculator_agent`: a
function of (base_url, task, **kwargs) that talks to the policy through OpenAI chat completions (here with plain
httpx; the `openai` client works the same way: `OpenAI(base_url=base_url, api_key="none")`) and returns a reward,
or None to leave scoring to the env's reward functions."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from rollout_lib.envs.calculator import final_answer_score, find_tool_call, tool_result


def chat(client: httpx.Client, base_url: str, messages: list[dict], **extra) -> dict:
    response = client.post(f"{base_url}/chat/completions", json={"model": "policy", "messages": messages, **extra},
                           headers={"Authorization": "Bearer none"})
    response.raise_for_status()
    return response.json()


def calculator_agent(base_url: str, task: dict, max_rounds: int = 3) -> float:
    """The calculator protocol (envs/calculator.py) run by an agent: a `calc: <expression>` line in the model's
    answer is evaluated (by the calculator's own parser, never eval) and sent back as a user message; the reward is
    1 when the last answer's final number is the task's answer."""
    messages = [dict(message) for message in task["messages"]]
    text = ""
    with httpx.Client(timeout=60) as client:
        for _ in range(max_rounds):
            text = chat(client, base_url, messages)["choices"][0]["message"]["content"] or ""
            messages.append({"role": "assistant", "content": text})
            expression = find_tool_call(text)
            if expression is None:
                break
            messages.append({"role": "user", "content": tool_result(expression)})
    return final_answer_score(text, task["answer"]) if task.get("answer") else 0.0


# --- for tests/test_agents.py -----------------------------------------------------------------------------------


def two_turns(base_url: str, task: dict, follow_up: str = "Go on.") -> None:
    """Asks, then appends a user message after the answer (an append-only conversation); leaves scoring to the env."""
    with httpx.Client(timeout=30) as client:
        first = chat(client, base_url, task["messages"], logprobs=True)["choices"][0]["message"]
        chat(client, base_url, [*task["messages"], first, {"role": "user", "content": follow_up}])
    return None


def rewrites_history(base_url: str, task: dict) -> float:
    """Sends back an assistant message other than the one it was answered with: a new training sequence."""
    with httpx.Client(timeout=30) as client:
        chat(client, base_url, task["messages"])
        edited = {"role": "assistant", "content": "something the policy never wrote"}
        chat(client, base_url, [*task["messages"], edited, {"role": "user", "content": "Go on."}])
    return 0.5


async def interleaved(base_url: str, task: dict) -> float:
    """Async, three requests with pauses between them, so the agents of a step interleave theirs."""
    messages = [dict(message) for message in task["messages"]]
    async with httpx.AsyncClient(timeout=30) as client:
        for round_index in range(3):
            response = await client.post(f"{base_url}/chat/completions", json={"messages": messages})
            response.raise_for_status()
            messages.append(response.json()["choices"][0]["message"])
            messages.append({"role": "user", "content": f"{task['example_id']} round {round_index}"})
            await asyncio.sleep(0.01)
    return 1.0


def hangs(base_url: str, task: dict) -> float:
    time.sleep(60)
    return 1.0


def explodes(base_url: str, task: dict) -> float:
    raise RuntimeError(f"no luck with {task['example_id']}")


def greedy_asker(base_url: str, task: dict, requests: int = 3) -> float:
    """Asks the same question `requests` times (each a fresh conversation), raising on a refusal."""
    with httpx.Client(timeout=30) as client:
        for _ in range(requests):
            chat(client, base_url, task["messages"])
    return 1.0


ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Adds two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}


def calls_a_tool(base_url: str, task: dict) -> float:
    """Sends `tools`, runs the call it is answered with, and sends the result back as a tool message; the reward
    is 1 when the first answer was a well-formed call of `add`."""
    with httpx.Client(timeout=30) as client:
        choice = chat(client, base_url, task["messages"], tools=[ADD_TOOL])["choices"][0]
        message = choice["message"]
        results = [{"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                    "content": str(sum(json.loads(call["function"]["arguments"]).values()))}
                   for call in message.get("tool_calls") or []]
        chat(client, base_url, [*task["messages"], message, *results], tools=[ADD_TOOL])
    return float(choice["finish_reason"] == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "add")


def retries_shorter(base_url: str, task: dict) -> float:
    """Sends a follow-up past the context limit, is refused, and sends a short one instead; reward 1 on a 400."""
    with httpx.Client(timeout=30) as client:
        first = chat(client, base_url, task["messages"])["choices"][0]["message"]
        try:
            chat(client, base_url, [*task["messages"], first, {"role": "user", "content": "word " * 1500}])
            status = 200
        except httpx.HTTPStatusError as exc:
            status = exc.response.status_code
        chat(client, base_url, [*task["messages"], first, {"role": "user", "content": "short"}])
    return float(status == 400)
