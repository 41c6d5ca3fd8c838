"""Where an OpenEnv env's episodes run (envs/openenv_env.py): an instance of the Environment class in this process,
or a WebSocket session on a served one (openenv's GenericEnvClient), behind one interface.

A session `reset(seed)`s and `step(action)`s, each answering (observation fields, reward, done) as OpenEnv
serialises an observation; an action the environment refuses raises InvalidAction (the model's to read), anything
else that goes wrong raises OpenEnvFailure naming where (the class, or the server's URL)."""

from __future__ import annotations

import asyncio
import threading
import typing
from typing import Any

import httpx

from rollout_lib.reward.locate import import_reference

WHAT = "OpenEnv environment class"
INSTALL = ("pip install -e '.[openenv]' (or, keeping pillow 13: pip install --no-deps openenv-core==0.3.0 "
           "fastmcp==4.2.3, as scripts/setup.sh --test does)")
Outcome = tuple[dict[str, Any], float | None, bool]


class OpenEnvFailure(RuntimeError):
    """The environment (or its server) failed: the episode cannot go on. The message names where."""


class InvalidAction(ValueError):
    """The environment refused the action (it does not match the Action class)."""


def _openenv():
    try:
        from openenv.core import env_server
    except ImportError as exc:
        raise ValueError(f"OpenEnv environments need openenv-core ({exc}): {INSTALL}") from None
    return env_server


class InProcessEnvs:
    """The environment class, built once per episode with the settings' kwargs."""

    def __init__(self, settings):  # envs.openenv_env.OpenEnvSettings
        env_server = _openenv()
        self.serialize = env_server.serialize_observation
        self.where = f"OpenEnv environment {settings.environment}"
        self.env_class = import_reference(settings.environment, what=WHAT)
        if not (isinstance(self.env_class, type) and issubclass(self.env_class, env_server.Environment)):
            raise TypeError(f"{WHAT} {settings.environment!r} is not a subclass of openenv's Environment")
        self.action_class = action_class_of(self.env_class, env_server.Environment, env_server.Action)
        self.kwargs = settings.kwargs
        self.timeout_s = settings.timeout_s

    def action_schema(self) -> dict:
        return self.action_class.model_json_schema()

    def open(self) -> "InProcessSession":
        try:
            return InProcessSession(self, self.env_class(**self.kwargs))
        except Exception as exc:  # noqa: BLE001 - the user's class may raise anything: the episode fails
            raise OpenEnvFailure(f"{self.where}: building it raised {type(exc).__name__}: {exc}") from exc


class InProcessSession:
    """One episode's instance. Each reset, step and close runs on a daemon thread of its own, bounded by timeout_s:
    an environment that hangs fails its episode (the instance is then abandoned, its thread left to finish or not:
    a Python thread cannot be killed) instead of hanging the step."""

    def __init__(self, envs: InProcessEnvs, env):
        self.envs, self.env = envs, env
        self.abandoned = False

    def reset(self, seed: int) -> Outcome:
        return self._outcome("reset", lambda: self.env.reset(seed=seed))

    def step(self, action: dict) -> Outcome:
        from pydantic import ValidationError

        try:
            typed = self.envs.action_class.model_validate(action)
        except ValidationError as exc:
            raise InvalidAction("; ".join(f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}"
                                          for e in exc.errors())) from None
        return self._outcome("step", lambda: self.env.step(typed))

    def close(self) -> None:
        if not self.abandoned:
            try:
                self._bounded("close", self.env.close)
            except Exception:  # noqa: BLE001 - the episode is over either way
                pass

    def _outcome(self, what: str, call) -> Outcome:
        try:
            payload = self.envs.serialize(self._bounded(what, call))
        except OpenEnvFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's environment may raise anything: the episode fails
            raise OpenEnvFailure(f"{self.envs.where}: {what} raised {type(exc).__name__}: {exc}") from exc
        return payload["observation"], payload.get("reward"), bool(payload.get("done"))

    def _bounded(self, what: str, call):
        """call() on a daemon thread; its value or its exception, or OpenEnvFailure past timeout_s."""
        done, outcome = threading.Event(), {}

        def target() -> None:
            try:
                outcome["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the episode's thread
                outcome["error"] = exc
            done.set()

        threading.Thread(target=target, name=f"openenv-{what}", daemon=True).start()
        if not done.wait(self.envs.timeout_s):
            self.abandoned = True
            raise OpenEnvFailure(f"{self.envs.where}: {what} did not return within {self.envs.timeout_s}s "
                                 "(interaction.timeout_s)")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]


def action_class_of(env_class: type, environment: type, action: type) -> type:
    """The Action class an Environment subclass declares (`class MyEnv(Environment[MyAction, MyObs, State])`)."""
    for klass in env_class.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is environment:
                arguments = typing.get_args(base)
                if arguments and isinstance(arguments[0], type) and issubclass(arguments[0], action):
                    return arguments[0]
    raise TypeError(f"{WHAT} {env_class.__module__}.{env_class.__qualname__} does not say its Action class: declare "
                    "it as `class MyEnv(Environment[MyAction, MyObservation, State])`")


class ServedEnvs:
    """A served environment: one WebSocket session per episode (each has an environment of its own on the server),
    all driven from one event loop on a thread of their own, started with the first session and stopped when the
    last one closes (a step's interaction is built per step: no thread outlives its episodes)."""

    def __init__(self, settings):  # envs.openenv_env.OpenEnvSettings
        from openenv.core.generic_client import GenericEnvClient  # noqa: F401 - missing: say so now, not mid-step

        _openenv()
        self.url = settings.url.rstrip("/")
        self.where = f"OpenEnv server {self.url}"
        self.timeout_s = settings.timeout_s
        self.schemas = self._get("/schema")  # also the start-up probe: a server that does not answer fails here
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.open_sessions = 0

    def _get(self, path: str) -> dict:
        try:
            response = httpx.get(self.url + path, timeout=self.timeout_s)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ValueError(f"{self.where}: GET {path} failed ({type(exc).__name__}: {exc}); is the env server "
                             "running there?") from None

    def action_schema(self) -> dict:
        return self.schemas["action"]

    def open(self) -> "ServedSession":
        from openenv.core.generic_client import GenericEnvClient

        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, name="openenv-sessions", daemon=True)
            self.thread.start()
        self.open_sessions += 1
        return ServedSession(self, GenericEnvClient(base_url=self.url, connect_timeout_s=self.timeout_s,
                                                    message_timeout_s=self.timeout_s))

    def run(self, coroutine):
        # The client bounds each message by timeout_s; the margin only guards against a loop that never answers.
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(self.timeout_s * 2 + 5)

    def closed(self) -> None:
        """A session closed; with the last one, the loop and its thread stop."""
        self.open_sessions -= 1
        if self.open_sessions == 0 and self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            if not self.thread.is_alive():
                self.loop.close()
            self.loop = self.thread = None


class ServedSession:
    def __init__(self, envs: ServedEnvs, client):
        self.envs, self.client = envs, client

    def reset(self, seed: int) -> Outcome:
        return self._outcome("reset", lambda: self.client.reset(seed=seed))

    def step(self, action: dict) -> Outcome:
        return self._outcome("step", lambda: self.client.step(action))

    def close(self) -> None:
        try:
            self.envs.run(self.client.close())
        except Exception:  # noqa: BLE001 - the episode is over either way
            pass
        finally:
            self.envs.closed()

    def _outcome(self, what: str, request) -> Outcome:
        try:
            result = self.envs.run(request())
        except RuntimeError as exc:  # the server answered with an error message ("Server error: ... (code: X)")
            if "VALIDATION_ERROR" in str(exc):
                raise InvalidAction("the environment refused it (it does not match the action's schema)") from None
            raise OpenEnvFailure(f"{self.envs.where}: {what} failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a dead server, a closed socket, a timeout: the episode fails
            raise OpenEnvFailure(f"{self.envs.where}: {what} failed, the connection is lost "
                                 f"({type(exc).__name__}: {exc})") from exc
        return dict(result.observation), result.reward, bool(result.done)
