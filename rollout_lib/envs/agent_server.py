"""The step's OpenAI-compatible endpoint for agents: `POST /episodes/<id>/v1/chat/completions` and
`GET /episodes/<id>/v1/models` on 127.0.0.1, a free port, for as long as the step's agents run.

Each episode's agent gets the base URL `http://127.0.0.1:<port>/episodes/<id>/v1`, so concurrent agents are kept
apart by path (any API key is accepted: the server listens on loopback only). The server only speaks HTTP; what a
request samples is the `complete(episode_id, body)` coroutine it is built with (agent_episodes.py)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

MODEL_NAME = "policy"  # what /v1/models lists; a request may name any model: it is always the policy


class RequestError(Exception):
    """A request the endpoint refuses: answered with `status` and OpenAI's error shape, the message for the
    agent to read."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


Complete = Callable[[str, dict], Awaitable[dict]]


def build_app(complete: Complete):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                            status_code=status)

    async def chat_completions(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the request body is not a JSON object")
        try:
            return JSONResponse(await complete(request.path_params["episode"], body))
        except RequestError as exc:
            return error(exc.status, str(exc))

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "rollout"}]})

    return Starlette(routes=[Route("/episodes/{episode}/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/episodes/{episode}/v1/models", models, methods=["GET"])])


@asynccontextmanager
async def serving(complete: Complete):
    """The endpoint, up on a free loopback port for the block's duration; yields its root URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(complete), log_level="warning", lifespan="off",
                                           access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # raises why it could not start
                raise RuntimeError("the agents' endpoint stopped before it started")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def chat_completion(episode_id: str, request_index: int, model: str, content: str,
                    tool_calls: list[dict[str, Any]], finish_reason: str, prompt_ids: list[int], ids: list[int],
                    token_logprobs: list[dict] | None) -> dict:
    """OpenAI's chat.completion object (vLLM's `prompt_token_ids` / `token_ids` added: what verifiers reads)."""
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": f"chatcmpl-{episode_id}-{request_index}", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "token_ids": ids,
                     "logprobs": {"content": token_logprobs} if token_logprobs is not None else None}],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                  "total_tokens": len(prompt_ids) + len(ids)},
        "prompt_token_ids": prompt_ids,
    }
