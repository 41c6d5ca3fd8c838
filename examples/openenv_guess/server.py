"""The guess-the-number environment served: `python -m uvicorn examples.openenv_guess.server:app --host 127.0.0.1
--port 8000` from the repository root. OPENENV_GUESS_SESSIONS (default 64) bounds the concurrent WebSocket sessions:
a step opens one per episode (prompts_per_step x group_size)."""

import os

from openenv.core.env_server import create_app

from examples.openenv_guess.environment import GuessAction, GuessEnvironment, GuessObservation

app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="openenv_guess",
                 max_concurrent_envs=int(os.environ.get("OPENENV_GUESS_SESSIONS", "64")))
