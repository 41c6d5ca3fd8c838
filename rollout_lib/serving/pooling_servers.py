"""A reward model's pooling servers that someone else runs, given by URL (`reward_model = ..., base_url = [...]`):
connected and checked before any step, so that a wrong address, name or model fails the run in one line with
nothing scored.

What is checked, on every replica: it answers and serves the model name (`served_name`, else the one model its
/v1/models lists: pool.start); `POST /classify` on a probe input gives one score (a sequence classifier with one
output on vLLM's pooling runner, not a generation server); and the server tokenizes as the reward model's reference
does (tokenizers.py: the whole vocabulary's spread and every special token). The inputs are encoded here with the
reference's tokenizer and sent as token ids, so a server of another vocabulary would score the wrong tokens without
failing. Its weights cannot be compared without loading them here, which a model served elsewhere is meant to
avoid: the reference names the model, and is what the training identity hashes.
"""

from __future__ import annotations

from rollout_lib.serving.client import (BadResponse, RequestRejected, ServingError, base_model_names,
                                        normalize_base_url)
from rollout_lib.serving.pool import EndpointPool
from rollout_lib.serving.tokenizers import find_tokenizer_mismatch

_PROBE_TEXT = "Is this a reward model?"
_SERVE_IT = ("`rollout serve start <reference> --runner pooling` on that node, or `vllm serve <model> --runner "
             "pooling`")


class PoolingServerRefused(ServingError):
    """A server at a reward model's base_url is not usable as that reward model; the message says what to do."""


async def connect_pooling_servers(urls: list[str], served_name: str | None, tokenizer) -> EndpointPool:
    """The started pool over `urls`, checked as the module says; otherwise a PoolingServerRefused, one line naming
    the URL and what to do (the pool is closed then)."""
    pool = None
    try:
        name = served_name or await _the_one_served_model(urls[0])
        pool = EndpointPool(urls, name)  # no `recover`: a server given by URL is not rollout's to restart
        await pool.start()
        mismatch = await find_tokenizer_mismatch(pool, tokenizer, here="with the reward model's tokenizer",
                                                 chat_template=False)
        if mismatch:
            raise PoolingServerRefused(pool.url_list, f"{name!r} does not tokenize as the reward model's reference "
                                                      f"does ({mismatch}): serve that reference there")
        probe = tokenizer(_PROBE_TEXT)["input_ids"]
        for replica in pool.replicas:
            try:
                await replica.classify([probe])
            except BadResponse as exc:  # its detail names the endpoint
                raise PoolingServerRefused(replica.url, f"{exc.detail}: serve a reward model there (a sequence "
                                                        "classifier with one output)") from None
            except RequestRejected as exc:
                raise PoolingServerRefused(replica.url, f"{exc.detail}: serve the reward model there on vLLM's "
                                                        f"pooling runner ({_SERVE_IT})") from None
    except BaseException as exc:
        if pool is not None:
            await pool.aclose()
        if isinstance(exc, ServingError) and not isinstance(exc, PoolingServerRefused):
            raise _refused(exc) from None
        raise
    return pool


def _refused(exc: ServingError) -> PoolingServerRefused:
    if isinstance(exc, RequestRejected) and "not served" in exc.detail:  # it answers, under other names (client.py)
        return PoolingServerRefused(exc.url, f"{exc.detail}: set served_name to the name it serves the reward model "
                                             "under")
    return PoolingServerRefused(exc.url, f"{exc.detail}: start the reward model's pooling server there ({_SERVE_IT}) "
                                         "or correct the URL")


async def _the_one_served_model(url: str) -> str:
    names = await base_model_names(url, timeout_s=10.0)
    if len(names) != 1:
        raise PoolingServerRefused(normalize_base_url(url), f"serves {len(names)} models "
                                   f"({', '.join(names) or 'none'}): set served_name to the reward model's")
    return names[0]
