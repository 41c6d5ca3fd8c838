"""One async HTTP client for one replica of a served model (vLLM's OpenAI-compatible server).

    client = EndpointClient("http://127.0.0.1:8111", "tiny", timeout_s=60)
    gen = await client.generate([1, 2, 3], max_tokens=16, seed=7)   # Generation(token_ids, logprobs, finish_reason)
    logprobs = await client.score([1, 2, 3, 4])                      # log p(t_i | t_<i), i = 1..n-1
    text = await client.chat([{"role": "user", "content": "hi"}], max_tokens=32)
    ids = await client.tokenize(text="hello")

Prompts travel as token ids (`"prompt": [ids]`), so tokenisation cannot drift between the caller and the server.

httpx, not the `openai` package: one timeout per whole request and no hidden retries (why: docs/serving.md).

Errors are `ServingError`s whose message is one line that starts with the replica's URL. `ReplicaUnavailable`
(connection refused or reset, timeout, HTTP 5xx or 429) says the replica is dead, hung or overloaded: the pool
tries another one. `RequestRejected` (HTTP 4xx) and `BadResponse` (a reply of the wrong shape) are the caller's or
the server's bug: another replica of the same model would answer the same, so they are raised at once.

A vanished server (in-flight requests get HTTP 500, the next ones connection refused) is `ReplicaUnavailable` too.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_MAX_CONNECTIONS = 256


class ServingError(RuntimeError):
    """A served-model request failed; the message is one line naming the URL(s) involved."""

    def __init__(self, url: str, detail: str):
        self.url = url
        self.detail = " ".join(str(detail).split())  # one line
        super().__init__(f"{url}: {self.detail}")


class ReplicaUnavailable(ServingError):
    """The replica did not answer usefully (refused, reset, timed out, HTTP 5xx/429): worth trying another one."""

    def __init__(self, url: str, detail: str, *, timed_out: bool = False):
        super().__init__(url, detail)
        self.timed_out = timed_out


class RequestRejected(ServingError):
    """HTTP 4xx: the server refused this request (bad length, unknown model, ...); retrying elsewhere won't help."""

    def __init__(self, url: str, detail: str, *, status: int):
        super().__init__(url, detail)
        self.status = status


class BadResponse(ServingError):
    """The server answered 200 with a body of the wrong shape (missing fields, lengths that do not match)."""


@dataclass(frozen=True)
class Generation:
    """One sampled continuation. `logprobs[i]` is the server's logprob of `token_ids[i]`: of the distribution it was
    drawn from (after temperature and top-p) on a server started with `--logprobs-mode processed_logprobs`, as
    engine.py starts them; of the raw model (temperature 1) under vLLM's default, whatever the sampling temperature.
    A sampled stop token (EOS, `stop_token_ids`) is the last of `token_ids`, with its logprob."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def normalize_base_url(base_url: str) -> str:
    """The server root: 'http://h:p', 'http://h:p/' and 'http://h:p/v1' all give 'http://h:p'."""
    url = base_url.strip().rstrip("/")
    return url.removesuffix("/v1").rstrip("/")


class HttpSession:
    """httpx.AsyncClients for the running event loops, shared by every replica of a pool.

    A client's connections belong to the loop that opened them, and sync callers (Prefect tasks, maybe in several
    threads) run one `asyncio.run()` per batch: so each running loop gets its own client, made on first use and
    closed when that loop shuts down (an async generator parked in the loop: `asyncio.run` closes those before it
    closes the loop), or by `aclose()` from within the loop.
    """

    def __init__(self, max_connections: int = DEFAULT_MAX_CONNECTIONS, *,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.transport = transport  # tests: an httpx.MockTransport
        self._clients: dict[asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, Any, asyncio.Task]] = {}
        self._lock = threading.Lock()

    def get(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        entry = self._clients.get(loop)
        if entry is None:
            with self._lock:
                # Timeouts are applied per request by the callers (the whole request); httpx's own are off.
                client = httpx.AsyncClient(limits=self.limits, timeout=httpx.Timeout(None), transport=self.transport)
                closer = self._close_at_loop_shutdown(loop, client)
                entry = self._clients[loop] = (client, closer, loop.create_task(_start(closer)))
        return entry[0]

    async def _close_at_loop_shutdown(self, loop, client: httpx.AsyncClient):
        try:
            yield
        finally:
            with self._lock:
                self._clients.pop(loop, None)
            await client.aclose()

    async def aclose(self) -> None:
        """Close the running loop's client (those of finished loops were closed with their loops)."""
        entry = self._clients.get(asyncio.get_running_loop())
        if entry is not None:
            _, closer, started = entry
            await started  # a generator is closed only once it has started
            await closer.aclose()


async def _start(generator) -> None:
    await anext(generator)  # runs to the `yield`: from now on the loop knows the generator and closes it at shutdown


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:300]


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class EndpointClient:
    """One replica: `base_url` (with or without a trailing /v1) serving `model`. Stateless apart from the HTTP
    session, which may be shared (`session=`) with other clients."""

    def __init__(self, base_url: str, model: str, *, timeout_s: float | None = 120.0,
                 session: HttpSession | None = None):
        self.url = normalize_base_url(base_url)
        self.model = model
        self.timeout_s = timeout_s
        self.session = session or HttpSession()

    def __repr__(self) -> str:
        return f"EndpointClient({self.url!r}, {self.model!r})"

    async def aclose(self) -> None:
        await self.session.aclose()

    # --- transport --------------------------------------------------------------------------------------------

    async def request(self, method: str, path: str, body: dict | None = None, *,
                      timeout_s: float | None = ...) -> Any:
        """One HTTP request -> its JSON body; every failure is a ServingError naming this URL. `timeout_s` bounds the
        whole request (default: the client's; None: no limit)."""
        timeout_s = self.timeout_s if timeout_s is ... else timeout_s
        http = self.session.get()
        try:
            async with asyncio.timeout(timeout_s):
                response = await http.request(method, self.url + path, json=body)
        except TimeoutError:
            raise ReplicaUnavailable(self.url, f"no answer within {timeout_s:g} s ({method} {path})",
                                     timed_out=True) from None
        except httpx.TimeoutException as exc:
            raise ReplicaUnavailable(self.url, f"{method} {path}: {_describe(exc)}", timed_out=True) from None
        except httpx.ConnectError as exc:
            raise ReplicaUnavailable(self.url, f"{method} {path}: unreachable ({_describe(exc)})") from None
        except httpx.TransportError as exc:  # reset, remote disconnected, ...
            raise ReplicaUnavailable(self.url, f"{method} {path}: {_describe(exc)}") from None
        status = response.status_code
        if status >= 500 or status == 429:
            raise ReplicaUnavailable(self.url, f"{method} {path}: HTTP {status}: {_error_message(response)}")
        if status >= 400:
            raise RequestRejected(self.url, f"{method} {path}: HTTP {status}: {_error_message(response)}",
                                  status=status)
        try:
            return response.json()
        except ValueError:
            raise BadResponse(self.url, f"{method} {path}: HTTP {status} with a body that is not JSON: "
                                        f"{response.text[:200]!r}") from None

    def _choice(self, body: Any, path: str) -> dict:
        try:
            choice = body["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise BadResponse(self.url, f"{path}: no choices in the reply: {str(body)[:200]}") from None
        if not isinstance(choice, dict):
            raise BadResponse(self.url, f"{path}: choice is not an object: {str(choice)[:200]}")
        return choice

    # --- the API ----------------------------------------------------------------------------------------------

    async def models(self, *, timeout_s: float | None = ..., adapters: bool = True) -> dict[str, int | None]:
        """GET /v1/models: served model name -> its max_model_len. `adapters=False`: the base models alone, without
        the LoRA adapters loaded on them (vLLM lists each with its base as `parent`)."""
        body = await self.request("GET", "/v1/models", timeout_s=timeout_s)
        try:
            return {entry["id"]: entry.get("max_model_len") for entry in body["data"]
                    if adapters or entry.get("parent") is None}
        except (KeyError, TypeError):
            raise BadResponse(self.url, f"/v1/models: unexpected reply: {str(body)[:200]}") from None

    async def check(self, *, timeout_s: float | None = ...) -> int | None:
        """Is this replica up and serving `model`? Returns its max_model_len; raises a ServingError naming the URL:
        ReplicaUnavailable when it does not answer, RequestRejected when it serves other models."""
        served = await self.models(timeout_s=timeout_s)
        if self.model not in served:
            names = ", ".join(repr(name) for name in served) or "nothing"
            raise RequestRejected(self.url, f"model {self.model!r} not served (serves: {names})", status=404)
        return served[self.model]

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, seed: int | None = None,
                       stop_token_ids: list[int] | None = None) -> Generation:
        """Sample a continuation of `prompt_ids`: its token ids, their logprobs and why it stopped."""
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(prompt_ids), "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "logprobs": 0, "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        choice = self._choice(await self.request("POST", "/v1/completions", body), "/v1/completions")
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(token_ids, list) or not isinstance(logprobs, list):
            raise BadResponse(self.url, "/v1/completions: reply lacks token_ids or logprobs.token_logprobs "
                                        "(does this server support return_token_ids?)")
        if len(token_ids) != len(logprobs):
            raise BadResponse(self.url, f"/v1/completions: {len(token_ids)} token ids but {len(logprobs)} logprobs")
        if any(value is None for value in logprobs):
            raise BadResponse(self.url, "/v1/completions: a generated token has no logprob")
        return Generation([int(t) for t in token_ids], [float(v) for v in logprobs],
                          str(choice.get("finish_reason")))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory `path` as the model `name` (vLLM's runtime LoRA loading, in place: an
        adapter already loaded under that name is replaced). The server must run with --enable-lora and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=True."""
        try:
            await self.request("POST", "/v1/load_lora_adapter",
                               {"lora_name": name, "lora_path": path, "load_inplace": True})
        except BadResponse:  # success: vLLM answers a plain-text line, not JSON
            pass

    async def score(self, token_ids: list[int]) -> list[float]:
        """Prefill scoring: log p(token_ids[t] | token_ids[:t]) for t = 1..n-1 (n - 1 values), at temperature 1.

        Each position's entry may hold the sent token and the top tokens: the value is selected by the id sent, never
        by position. A sequence can be at most max_model_len - 1 tokens (the request samples one token after it)."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("score: token_ids is empty")
        body = {"model": self.model, "prompt": token_ids, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0}
        choice = self._choice(await self.request("POST", "/v1/completions", body), "/v1/completions")
        entries = choice.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(token_ids):
            got = len(entries) if isinstance(entries, list) else type(entries).__name__
            raise BadResponse(self.url, f"/v1/completions: prompt_logprobs has {got} entries for "
                                        f"{len(token_ids)} prompt tokens")
        values = []
        for position in range(1, len(token_ids)):
            entry = entries[position]
            key = str(token_ids[position])
            if not isinstance(entry, dict) or not isinstance(entry.get(key), dict):
                raise BadResponse(self.url, f"/v1/completions: prompt_logprobs[{position}] lacks the sent token "
                                            f"id {key} (has {sorted(entry) if isinstance(entry, dict) else entry})")
            values.append(float(entry[key]["logprob"]))
        return values

    async def classify(self, inputs: list[list[int]]) -> list[float]:
        """POST /classify (a sequence classifier served with `--runner pooling`): the raw score (no activation) of
        each token-id input, in order. A reward model has one output; more is an error naming this URL."""
        body = {"model": self.model, "input": [[int(t) for t in ids] for ids in inputs], "use_activation": False}
        reply = await self.request("POST", "/classify", body)
        data = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(data, list) or len(data) != len(inputs):
            got = len(data) if isinstance(data, list) else type(data).__name__
            raise BadResponse(self.url, f"/classify: {got} results for {len(inputs)} inputs: {str(reply)[:200]}")
        scores = []
        for entry in sorted(data, key=lambda entry: entry.get("index", 0) if isinstance(entry, dict) else 0):
            probs = entry.get("probs") if isinstance(entry, dict) else None
            if not isinstance(probs, list) or len(probs) != 1:
                raise BadResponse(self.url, f"/classify: expected one score per input (a reward model), got "
                                            f"{str(probs)[:100]}")
            scores.append(float(probs[0]))
        return scores

    async def chat(self, messages: list[dict], *, max_tokens: int, temperature: float = 1.0,
                   seed: int | None = None) -> str:
        """POST /v1/chat/completions: the assistant message's text (the server applies the chat template)."""
        body: dict[str, Any] = {"model": self.model, "messages": list(messages), "max_tokens": max_tokens,
                                "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        choice = self._choice(await self.request("POST", "/v1/chat/completions", body), "/v1/chat/completions")
        content = (choice.get("message") or {}).get("content")
        if not isinstance(content, str):
            raise BadResponse(self.url, f"/v1/chat/completions: no message content: {str(choice)[:200]}")
        return content

    async def tokenize(self, text: str | None = None, messages: list[dict] | None = None, *,
                       add_generation_prompt: bool = True, add_special_tokens: bool = True) -> list[int]:
        """The server's token ids for `text`, or for `messages` rendered with its chat template."""
        if (text is None) == (messages is None):
            raise ValueError("tokenize: give exactly one of text= and messages=")
        if text is not None:
            body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        else:
            body = {"model": self.model, "messages": list(messages), "add_generation_prompt": add_generation_prompt}
        reply = await self.request("POST", "/tokenize", body)
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list):
            raise BadResponse(self.url, f"/tokenize: no tokens in the reply: {str(reply)[:200]}")
        return [int(t) for t in tokens]


async def base_model_names(base_url: str, *, timeout_s: float | None = 30.0) -> list[str]:
    """The base models a server at `base_url` serves (GET /v1/models, the LoRA adapters loaded on them left out:
    vLLM lists each with its base as `parent`), through a client of its own; a ServingError naming the URL if it
    does not answer."""
    client = EndpointClient(base_url, "", timeout_s=timeout_s)
    try:
        return list(await client.models(adapters=False))
    finally:
        await client.aclose()
