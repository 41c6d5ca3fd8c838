"""Guess the number, as an OpenEnv environment: `reset(seed)` draws a secret from 1 to 8, each step's action is a
guess ({"guess": 5}), the observation says "higher", "lower" or "correct" (reward 1.0 and done). No network, no
model: it runs in-process (`environment = "examples.openenv_guess.environment:GuessEnvironment"`) and served
(examples/openenv_guess/server.py)."""

from __future__ import annotations

import random
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State

LOW, HIGH = 1, 8


class GuessAction(Action):
    """A guess of the secret number."""

    guess: int


class GuessObservation(Observation):
    feedback: str


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets an instance of its own

    def __init__(self, low: int = LOW, high: int = HIGH):
        super().__init__()
        self.low, self.high = low, high
        self.secret = low
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(self.low, self.high)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(feedback=f'Guess my number from {self.low} to {self.high}. Answer with JSON: '
                                         f'{{"guess": <number>}}.')

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self.secret:
            return GuessObservation(feedback="correct", reward=1.0, done=True)
        return GuessObservation(feedback="higher" if action.guess < self.secret else "lower", reward=0.0)

    @property
    def state(self) -> State:
        return self._state
