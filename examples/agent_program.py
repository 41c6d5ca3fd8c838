#!/usr/bin/env python3
"""An agent as a program (`interaction = { type = "agent", command = ["python3", "examples/agent_program.py"] }`):
the calculator protocol over the episode's OpenAI-compatible endpoint, with the standard library only (any language
works the same way: read the task on stdin, talk to $OPENAI_BASE_URL, print the reward as the last line).

stdin: {"task": {"example_id", "messages", "answer", "info"}, "kwargs": {...}}. Each model answer with a
`calc: <expression>` line (two integers and one of + - * /) gets the result back as a user message, at most
`max_rounds` times; the reward is 1.0 when the last answer's last number is the task's answer, else 0.0.
`--mode` makes it misbehave for rollout's tests: exit 3 with a message on stderr, hang, or print no result.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.request

CALL = re.compile(r"calc:\s*(-?\d+)\s*([-+*/])\s*(-?\d+)")


def chat(messages: list[dict]) -> str:
    request = urllib.request.Request(
        f"{os.environ['OPENAI_BASE_URL']}/chat/completions",
        data=json.dumps({"model": os.environ["ROLLOUT_MODEL"], "messages": messages}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["choices"][0]["message"]["content"] or ""


def calculate(left: str, operator: str, right: str) -> str:
    a, b = int(left), int(right)
    if operator == "/":
        return "error: division by zero" if b == 0 else str(a / b)
    return str({"+": a + b, "-": a - b, "*": a * b}[operator])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["play", "fail", "hang", "silent"], default="play")
    mode = parser.parse_args().mode
    given = json.load(sys.stdin)
    task, max_rounds = given["task"], given["kwargs"].get("max_rounds", 3)
    messages = list(task["messages"])
    text = chat(messages)
    if mode == "fail":
        sys.exit(f"no luck with {task['example_id']}")  # the message on stderr, exit code 1
    if mode == "hang":
        time.sleep(3600)
    if mode == "silent":
        return
    for _ in range(max_rounds - 1):
        messages.append({"role": "assistant", "content": text})
        call = CALL.search(text)
        if call is None:
            break
        messages.append({"role": "user", "content": f"result: {calculate(*call.groups())}"})
        text = chat(messages)
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    print(json.dumps({"reward": float(bool(numbers) and numbers[-1] == str(task["answer"]))}))


if __name__ == "__main__":
    main()
