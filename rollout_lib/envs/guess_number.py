"""A feedback env: the model guesses a secret integer, the env says "higher" or "lower" after each wrong guess.

The secret is the example's `answer` (an integer in [low, high]; no randomness, so a rerun replays the episode).
Each model turn's guess is the first integer in its text; the env answers one "user" message, "higher" (the
secret is above the guess) or "lower", or asks for a number when the turn has none (or one of more than 9
digits). A correct guess ends the episode.

Score: solving on model turn t (1-based) of T = max_turns scores (T - t + 1) / T, so 1.0 on the first turn, then
one T-th less per extra turn; 0.0 while unsolved. The driver shows the env the last allowed turn too (its reply
is not written), so with T = 4 the reachable scores are 1.0, 0.75, 0.5 and 0.25.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from rollout_lib.envs.base import EnvReply, Interaction, InteractionSettings

_INTEGER = re.compile(r"-?\d+")
MAX_GUESS_DIGITS = 9  # a longer "number" is no guess (and int() of thousands of digits is refused anyway)


class GuessNumberSettings(InteractionSettings):
    type: Literal["guess_number"] = "guess_number"
    max_turns: int = Field(4, ge=1)
    low: int = 1  # the secret's range, inclusive: checked against each example's answer, named in the feedback
    high: int = 8

    @model_validator(mode="after")
    def _range_not_empty(self) -> GuessNumberSettings:
        if self.low > self.high:
            raise ValueError(f"guess_number: low ({self.low}) is above high ({self.high})")
        return self


def first_guess(text: str) -> int | None:
    """The first integer in a turn, or None when it has none."""
    match = _INTEGER.search(text)
    if match is None or len(match.group().lstrip("-")) > MAX_GUESS_DIGITS:
        return None
    return int(match.group())


def solved_score(turn: int, max_turns: int) -> float:
    """The score of solving on model turn `turn` (1-based) of `max_turns`."""
    return max(0.0, (max_turns - turn + 1) / max_turns)


class GuessNumber(Interaction):
    type_name = "guess_number"
    settings_class = GuessNumberSettings

    def start(self, prompt: dict[str, Any]) -> dict[str, Any]:
        low, high = self.settings.low, self.settings.high
        answer = (prompt.get("answer") or "").strip()
        if not re.fullmatch(r"-?\d{1,9}", answer) or not low <= int(answer) <= high:
            where = prompt.get("example_id", "an example")
            raise ValueError(f"guess_number: {where} needs an integer 'answer' in [{low}, {high}] (the secret), "
                             f"got {prompt.get('answer')!r}")
        return {"secret": int(answer), "guesses": [], "solved": False, "score": 0.0}

    def respond(self, state: dict[str, Any], messages: list[dict[str, str]]) -> EnvReply:
        guess = first_guess(messages[-1]["content"])
        state["guesses"].append(guess)  # None for a turn without a number: len(guesses) counts model turns
        if guess is None:
            return _say(f"Answer with a number from {self.settings.low} to {self.settings.high}.")
        if guess == state["secret"]:
            state["solved"] = True
            state["score"] = solved_score(len(state["guesses"]), self.settings.max_turns)
            return EnvReply(done=True)
        return _say("higher" if guess < state["secret"] else "lower")


def _say(text: str) -> EnvReply:
    return EnvReply(messages=[{"role": "user", "content": text}])
