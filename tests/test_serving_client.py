"""The one-replica client (rollout_lib/serving/client.py) against a real vLLM server of the tiny Qwen2 (the session's
`vllm_tiny` fixture): served logprobs agree with transformers' on the same weights, seeded sampling repeats. The
reply-shape checks run against httpx.MockTransport replies, no server.

Measured agreement on this machine (fp32, 2 CPU cores): generation logprobs within 4.8e-7 of transformers', prefill
scoring within 9.5e-7 (2..511 tokens). The tests allow 1e-5: the engine's float sums depend on batch composition
(../shared/notes/serving.md). Servers started by engine.py run `--logprobs-mode processed_logprobs`: a sampled
token's logprob is of the distribution it was drawn from (here: logits / temperature); vLLM's default
(raw_logprobs) would report the temperature-1 model's whatever the sampling temperature.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from rollout_lib.serving.client import (
    BadResponse,
    EndpointClient,
    HttpSession,
    ReplicaUnavailable,
    RequestRejected,
    ServingError,
    normalize_base_url,
)

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def transformers_model(vllm_tiny_session):  # the served files, loaded once for the module
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(vllm_tiny_session.model_dir), dtype=torch.float32).eval()
    return model


def reference_logprobs(model, ids: list[int], temperature: float = 1.0) -> list[float]:
    """log p(ids[t] | ids[:t]) for t = 1..n-1 from an in-process fp32 forward, of softmax(logits / temperature)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [logprobs[t - 1, ids[t]].item() for t in range(1, len(ids))]


def client_for(vllm_tiny) -> EndpointClient:
    return EndpointClient(vllm_tiny.base_urls[0], vllm_tiny.name, timeout_s=120)


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.slow
def test_generation_logprobs_agree_with_transformers(vllm_tiny, transformers_model):
    client = client_for(vllm_tiny)
    rng = random.Random(0)
    vocab = transformers_model.config.vocab_size
    prompts = [random_ids(rng, rng.randrange(4, 40), vocab) for _ in range(6)]
    cases = [(prompt, temperature) for prompt in prompts for temperature in (1.0, 0.6)]

    async def sample():
        return await asyncio.gather(*(client.generate(prompt, max_tokens=24, temperature=temperature, seed=i)
                                      for i, (prompt, temperature) in enumerate(cases)))

    generations = asyncio.run(sample())
    worst = (0.0, None)
    for case, ((prompt, temperature), generation) in enumerate(zip(cases, generations)):
        assert 1 <= len(generation.token_ids) == len(generation.logprobs) <= 24
        # A row that sampled EOS stops early; the EOS token is in token_ids, with its logprob.
        assert generation.finish_reason == ("length" if len(generation.token_ids) == 24 else "stop")
        # processed_logprobs (engine.py's servers): the logprobs of the distribution sampled from, at its temperature.
        expected = reference_logprobs(transformers_model, prompt + generation.token_ids,
                                      temperature)[len(prompt) - 1:]
        for position, (a, b) in enumerate(zip(expected, generation.logprobs)):
            if abs(a - b) > worst[0]:
                worst = (abs(a - b), f"case {case} (temperature {temperature}, prompt {prompt}, generated "
                                     f"{generation.token_ids}, {generation.finish_reason}) token {position}: "
                                     f"transformers {a:.6f}, vLLM {b:.6f}")
    assert worst[0] < TOLERANCE, f"max |vLLM - transformers| over generated tokens: {worst[0]:.2e} at {worst[1]}"


@pytest.mark.slow
def test_prefill_scoring_agrees_with_transformers(vllm_tiny, transformers_model):
    client = client_for(vllm_tiny)
    rng = random.Random(1)
    vocab = transformers_model.config.vocab_size
    sequences = [random_ids(rng, n, vocab) for n in (2, 17, 128, 300)]
    scores = asyncio.run(_gather(client.score(ids) for ids in sequences))
    for ids, served in zip(sequences, scores):
        expected = reference_logprobs(transformers_model, ids)
        assert len(served) == len(ids) - 1
        worst = max(abs(a - b) for a, b in zip(expected, served))
        assert worst < TOLERANCE, f"{len(ids)} tokens: max |vLLM - transformers| {worst:.2e}"


@pytest.mark.slow
def test_seeded_sampling_repeats_and_seeds_differ(vllm_tiny):
    client = client_for(vllm_tiny)
    prompt = [5, 17, 42, 9, 100]

    async def sample(seeds):
        return await asyncio.gather(*(client.generate(prompt, max_tokens=16, seed=seed) for seed in seeds))

    first, second = asyncio.run(sample([11, 12, 13])), asyncio.run(sample([13, 11, 12]))  # another order, loop
    by_seed = dict(zip([11, 12, 13], first))
    for seed, generation in zip([13, 11, 12], second):
        assert generation.token_ids == by_seed[seed].token_ids
    assert len({tuple(g.token_ids) for g in first}) == 3, "three seeds gave identical samples"

    # A stop token ends the sample and is its last token.
    full = by_seed[11].token_ids
    stop = full[2]
    stopped = asyncio.run(client.generate(prompt, max_tokens=16, seed=11, stop_token_ids=[stop]))
    assert stopped.token_ids == full[: full.index(stop) + 1] and stopped.finish_reason == "stop"


@pytest.mark.slow
def test_models_chat_tokenize_and_errors(vllm_tiny):
    client = EndpointClient(vllm_tiny.base_urls[0] + "/v1/", vllm_tiny.name)

    async def run():
        served = await client.models()
        text = await client.chat([{"role": "user", "content": "hi"}], max_tokens=4, seed=1)
        ids = await client.tokenize(text="hello world")
        chat_ids = await client.tokenize(messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(RequestRejected) as too_long:
            await client.generate([5] * (served[vllm_tiny.name] + 10), max_tokens=4)
        with pytest.raises(RequestRejected) as wrong_name:
            await EndpointClient(vllm_tiny.base_urls[0], "no-such-model").check()
        return served, text, ids, chat_ids, too_long.value, wrong_name.value

    served, text, ids, chat_ids, too_long, wrong_name = asyncio.run(run())
    assert isinstance(served[vllm_tiny.name], int) and served[vllm_tiny.name] > 0  # max_model_len
    assert isinstance(text, str)
    assert ids and all(isinstance(t, int) for t in ids) and len(chat_ids) > len(ids) // 2
    url = normalize_base_url(vllm_tiny.base_urls[0])
    for error in (too_long, wrong_name):
        assert str(error).startswith(url + ": ") and "\n" not in str(error)
    assert "maximum context length" in str(too_long)
    assert f"model 'no-such-model' not served (serves: '{vllm_tiny.name}')" in str(wrong_name)


# --- reply shapes, against canned replies -------------------------------------------------------------------------

def mock_client(reply: dict | None = None, status: int = 200, exc: Exception | None = None) -> EndpointClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if exc is not None:
            raise exc
        return httpx.Response(status, json=reply)

    return EndpointClient("http://replica.test:8000/v1", "m", session=HttpSession(transport=httpx.MockTransport(handler)))


def completion(**choice) -> dict:
    return {"choices": [{"finish_reason": "length", **choice}]}


def test_normalize_base_url():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/", " http://h:1/v1 "):
        assert normalize_base_url(url) == "http://h:1"


def test_generation_length_mismatch_raises():
    client = mock_client(completion(token_ids=[1, 2, 3], logprobs={"token_logprobs": [-1.0, -2.0]}))
    with pytest.raises(BadResponse, match=r"^http://replica.test:8000: .*3 token ids but 2 logprobs"):
        asyncio.run(client.generate([1], max_tokens=3))
    client = mock_client(completion(text="x", logprobs=None))
    with pytest.raises(BadResponse, match="lacks token_ids"):
        asyncio.run(client.generate([1], max_tokens=3))


def test_scoring_selects_by_sent_id_and_checks_shape():
    entry = {"9": {"logprob": -0.1, "rank": 1}, "7": {"logprob": -3.0, "rank": 5}}  # top token first, sent id second
    client = mock_client(completion(prompt_logprobs=[None, entry]))
    assert asyncio.run(client.score([4, 7])) == [-3.0]

    client = mock_client(completion(prompt_logprobs=[None, {"9": {"logprob": -0.1}}]))
    with pytest.raises(BadResponse, match=r"prompt_logprobs\[1\] lacks the sent token id 7"):
        asyncio.run(client.score([4, 7]))
    client = mock_client(completion(prompt_logprobs=[None, entry]))
    with pytest.raises(BadResponse, match="prompt_logprobs has 2 entries for 3 prompt tokens"):
        asyncio.run(client.score([4, 7, 7]))
    client = mock_client({"object": "error"})
    with pytest.raises(BadResponse, match="no choices"):
        asyncio.run(client.score([4, 7]))


def test_errors_are_classified_and_name_the_url():
    cases = [
        (mock_client({"error": {"message": "boom"}}, status=500), ReplicaUnavailable, "HTTP 500: boom"),
        (mock_client({"error": {"message": "slow down"}}, status=429), ReplicaUnavailable, "HTTP 429"),
        (mock_client({"error": {"message": "bad max_tokens"}}, status=400), RequestRejected, "bad max_tokens"),
        (mock_client(exc=httpx.ConnectError("refused")), ReplicaUnavailable, "unreachable"),
        (mock_client(exc=httpx.RemoteProtocolError("Server disconnected")), ReplicaUnavailable, "disconnected"),
        (mock_client(exc=httpx.ReadTimeout("read")), ReplicaUnavailable, "ReadTimeout"),
    ]
    for client, kind, words in cases:
        with pytest.raises(ServingError) as caught:
            asyncio.run(client.generate([1], max_tokens=1))
        assert type(caught.value) is kind, (words, caught.value)
        message = str(caught.value)
        assert message.startswith("http://replica.test:8000: ") and words in message and "\n" not in message


def test_timeout_bounds_the_whole_request():
    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200, json={})

    client = EndpointClient("http://replica.test:8000", "m", timeout_s=0.2,
                            session=HttpSession(transport=httpx.MockTransport(hang)))
    with pytest.raises(ReplicaUnavailable, match=r"no answer within 0.2 s") as caught:
        asyncio.run(client.score([1, 2]))
    assert caught.value.timed_out


def test_one_client_serves_successive_event_loops():
    seen_loops = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen_loops.append(asyncio.get_running_loop())
        return httpx.Response(200, json={"tokens": [1, 2]})

    client = EndpointClient("http://replica.test:8000", "m", session=HttpSession(transport=httpx.MockTransport(handler)))
    for _ in range(3):
        assert asyncio.run(client.tokenize(text="x")) == [1, 2]
    assert len(set(map(id, seen_loops))) == 3
    assert client.session._clients == {}  # each loop's httpx client was closed when its loop shut down


async def _gather(awaitables):
    return await asyncio.gather(*awaitables)
