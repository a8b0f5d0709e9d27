"""`dlm-jax serve` against real clients: OpenAI's Python client and httpx, over loopback, to
the real ASGI server (uvicorn) started in the test on an ephemeral port.

The module's server decodes llada-tiny with fast-dllm (generation 32, 4 batch rows); its
warm-up builds the programs those requests reach. Every loop waiting on the server is
bounded in time. The SIGTERM test runs the command itself, in a process of its own.
"""

from __future__ import annotations

import concurrent.futures as futures
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

import dlm_jax
from dlm_jax.frontends import server as srv

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "llada-tiny"
NAME = "llada-tiny"
PROMPTS = ["564+894=", "66+76=", "sort: 37 44 13 33 47 48", "sort: 9 3 27",
           "Uma has 4 keys. She sells 2. She loses 1. She buys 2 more. How many keys does Uma have now?"]
DEADLINE = 60.0  # seconds any one wait on the server may take


class LiveServer:
    """`build_app(service)` under uvicorn on a thread, listening on 127.0.0.1:<free port>."""

    def __init__(self, service: srv.Service, *, ready_timeout: float = DEADLINE):
        import uvicorn

        self.service = service
        self.sock = srv.bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(srv.build_app(service), log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: _health(self.url) == 200, what="the server to be ready", timeout=ready_timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(DEADLINE)
        self.sock.close()


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def wait_until(check, *, what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def model():
    return dlm_jax.load(TINY, executor="jax")


@pytest.fixture(scope="module")
def live(model):
    service = srv.Service(model, dlm_jax.preset("fast-dllm", gen_len=32), name=NAME, max_batch=4, max_tokens=128)
    server = LiveServer(service)
    yield server
    server.stop()


def post(live, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(live.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=DEADLINE, **kw)


def stream_text(live, path: str, body: dict) -> tuple[str, list[dict]]:
    """A streamed request's text (the pieces joined) and its chunks, read to `[DONE]`."""
    chunks, done = [], False
    with httpx.stream("POST", live.url + path, json={**body, "stream": True}, timeout=DEADLINE) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:]))
    assert done, "the stream ended without data: [DONE]"
    assert not any("error" in c for c in chunks), chunks
    key = "text" if path.endswith("/completions") and "chat" not in path else None
    pieces = [c["choices"][0]["text"] if key else c["choices"][0]["delta"].get("content", "")
              for c in chunks if c.get("choices")]
    return "".join(pieces), chunks


# ---------------------------------------------------------------------------- the OpenAI client


def test_openai_client_completions_and_chat(live, model):
    """OpenAI's own client, streaming and not, gets what `Model.generate` decodes for the
    same prompts (the checkpoint's chat format for text prompts), with usage."""
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
    assert [m.id for m in client.models.list().data] == [NAME]
    cfg = dlm_jax.preset("fast-dllm", gen_len=32)
    want = model.generate(PROMPTS[:3], cfg)
    for prompt, text, ids in zip(PROMPTS[:3], want.texts, want.token_ids):
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=32)
        assert got.choices[0].text == text and got.choices[0].finish_reason == "stop"
        assert got.usage.completion_tokens == len(ids)
        assert got.usage.prompt_tokens == len(model.encode(prompt))
        pieces = [c.choices[0].text for c in client.completions.create(model=NAME, prompt=prompt, max_tokens=32,
                                                                        stream=True)]
        assert "".join(pieces) == text
        chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=32)
        assert chat.choices[0].message.content == text  # the same prompt: llada-tiny's format is chat
        assert chat.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=32, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == len(ids)
    # The decode options of the registry, through the client's extra body.
    frechet = model.generate([PROMPTS[2]], dlm_jax.preset("frechet", gen_len=32)).texts[0]
    got = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=32,
                                    extra_body={"dlm_jax": {"preset": "frechet"}})
    assert got.choices[0].text == frechet
    with pytest.raises(openai.BadRequestError, match="delta"):
        client.completions.create(model=NAME, prompt="1+1=", extra_body={"dlm_jax": {"delta": "big"}})
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="1+1=")


def test_logprobs_through_the_openai_client(live, model):
    """logprobs on both endpoints, streamed or not, through OpenAI's client: each completion
    token's log-probability and its likeliest alternatives are `Model.generate`'s (decode
    option `logprobs`; the server's engine runs other programs than a fixed batch, so to
    float32 rounding: `docs/engine.md`), the tokens spell the text, a stream's chunks carry
    each token once; a stop string cuts them with the text."""
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
    prompt = PROMPTS[2]
    want = model.generate([prompt], dlm_jax.preset("fast-dllm", gen_len=32, logprobs=2))
    text, lp = want.texts[0], want.logprobs[0]
    pieces = [model.tokenizer.decode([t]) for t in want.token_ids[0]]
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, logprobs=2).choices[0]
    assert got.text == text and got.logprobs.tokens == pieces and "".join(got.logprobs.tokens) == text
    near = functools.partial(pytest.approx, rel=1e-5, abs=1e-7)
    assert got.logprobs.token_logprobs == near([float(x) for x in lp.logprob])
    assert got.logprobs.text_offset == [len("".join(pieces[:j])) for j in range(len(pieces))]
    for top, tok, ids, values in zip(got.logprobs.top_logprobs, pieces, lp.top_ids, lp.top_logprob):
        assert top == near({**{model.tokenizer.decode([int(t)]): float(v) for t, v in zip(ids, values)},
                            tok: top[tok]})  # the two likeliest, and the chosen token always
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=32, logprobs=True,
                                          top_logprobs=2).choices[0]
    content = chat.logprobs.content
    assert [c.token for c in content] == pieces and [c.logprob for c in content] == near([float(x) for x in lp.logprob])
    assert [t.logprob for c in content for t in c.top_logprobs] == near(lp.top_logprob.ravel().tolist())
    assert all(c.bytes == list(c.token.encode()) for c in content)  # (ASCII here)
    assert bytes(b for c in content for b in c.bytes).decode() == chat.message.content
    # A byte token that is part of a character: its `bytes` are that byte, not its text's U+FFFD.
    lead = 0xC3  # the first byte of "é" in the shipped byte tokenizer
    forced = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, logprobs=True,
                                            top_logprobs=2, logit_bias={str(lead): 100}).choices[0]
    assert forced.logprobs.content and all(c.bytes == [lead] and c.token == "\ufffd" for c in forced.logprobs.content)
    assert all(len(t.bytes) == 1 and t.bytes[0] >= 0x80 for c in forced.logprobs.content for t in c.top_logprobs
               if t.token == "\ufffd")
    streamed, shown = [], ""
    for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=32, logprobs=True,
                                                stream=True):
        shown += chunk.choices[0].delta.content or ""
        streamed += [c.token for c in chunk.choices[0].logprobs.content] if chunk.choices[0].logprobs else []
        assert shown.startswith("".join(streamed))  # no token before its text
    assert streamed == pieces and shown == text
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=32).choices[0]
    assert plain.logprobs is None and plain.message.content == text
    cut = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, logprobs=0, stop=[text[3:6]])
    assert cut.choices[0].text == text[:3] and "".join(cut.choices[0].logprobs.tokens) == text[:3]
    assert cut.choices[0].logprobs.token_logprobs == got.logprobs.token_logprobs[:len(cut.choices[0].logprobs.tokens)]


def test_penalties_and_logit_bias_from_the_openai_client(live, model):
    """presence / frequency penalties decode as the decode options of the same names;
    logit_bias steers every slot's distribution (-100: never proposed, 100: always)."""
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
    for field in ("presence_penalty", "frequency_penalty"):
        want = model.generate([PROMPTS[4]], dlm_jax.preset("fast-dllm", gen_len=32, **{field: -2.0})).texts[0]
        got = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=32, **{field: -2.0})
        assert got.choices[0].text == want
    three = str(model.encode("3", chat=False)[-1])
    plain = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=32).choices[0].text
    banned = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=32, logit_bias={three: -100})
    forced = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[2]}],
                                            max_tokens=32, logit_bias={three: 100})
    assert "3" in plain and "3" not in banned.choices[0].text and set(forced.choices[0].message.content) == {"3"}


def test_best_of_and_echo(live, model):
    """best_of: each prompt's n choices are, of its best_of decodes (candidate j with seed
    seed + j), those with the highest mean token log-probability, best first; the usage counts
    every candidate. echo: each choice's text starts with its prompt's, streamed or not."""
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
    prompt = PROMPTS[4]
    out = model.generate([prompt] * 4, dlm_jax.preset("fast-dllm", gen_len=32, temperature=1.5, logprobs=0),
                         seeds=[7, 8, 9, 10])
    score = [float(np.mean(lp.logprob)) for lp in out.logprobs]
    assert len(set(out.texts)) > 1 and len(set(score)) == 4  # (candidates differ: the choice is a choice)
    best = sorted(range(4), key=lambda j: -score[j])[:2]
    got = client.completions.create(model=NAME, prompt=prompt, n=2, best_of=4, seed=7, temperature=1.5, max_tokens=32)
    assert [c.text for c in got.choices] == [out.texts[j] for j in best] and [c.index for c in got.choices] == [0, 1]
    assert got.usage.completion_tokens == sum(len(ids) for ids in out.token_ids)
    with_lp = client.completions.create(model=NAME, prompt=prompt, best_of=4, seed=7, temperature=1.5, max_tokens=32,
                                        logprobs=1).choices[0]
    assert with_lp.text == out.texts[best[0]] and with_lp.logprobs.token_logprobs == out.logprobs[best[0]].logprob.tolist()
    plain = client.completions.create(model=NAME, prompt=prompt, best_of=4, seed=7, temperature=1.5, max_tokens=32)
    assert plain.choices[0].logprobs is None
    greedy = model.generate(PROMPTS[:2], dlm_jax.preset("fast-dllm", gen_len=32)).texts
    ids = model.encode(PROMPTS[1])
    echoed = client.completions.create(model=NAME, prompt=[PROMPTS[0], ids], max_tokens=32, echo=True)
    assert [c.text for c in echoed.choices] == [PROMPTS[0] + greedy[0], model.tokenizer.decode(ids) + greedy[1]]
    assert "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=32, echo=True, stream=True)) == PROMPTS[0] + greedy[0]


def test_suffix_infills_between_the_prompt_and_it(live, model):
    """suffix (completions): the completion is decoded between the prompt and the suffix's
    text (as it is), as `Model.generate`'s `suffixes` decodes it, streamed or not, for every
    prompt of the request."""
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
    cfg = dlm_jax.preset("fast-dllm", gen_len=32)
    want = model.generate(PROMPTS[:2], cfg, suffixes=[" 47 48"] * 2).texts
    got = client.completions.create(model=NAME, prompt=PROMPTS[:2], suffix=" 47 48", max_tokens=32)
    assert [c.text for c in got.choices] == want
    body = {"model": NAME, "prompt": PROMPTS[0], "suffix": " 47 48", "max_tokens": 32}
    assert stream_text(live, "/v1/completions", body)[0] == want[0]
    empty = client.completions.create(model=NAME, prompt=PROMPTS[0], suffix="", max_tokens=32).choices[0].text
    assert empty == model.generate(PROMPTS[0], cfg).texts[0]
    # Fewer tokens than a block: one block of them, all before the suffix (not 32 cut at 8).
    short = client.completions.create(model=NAME, prompt=PROMPTS[1], suffix=" 99", max_tokens=8).choices[0].text
    assert short == model.generate(PROMPTS[1], dlm_jax.preset("fast-dllm", gen_len=8, block_len=8),
                                   suffixes=[" 99"]).texts[0]  # (here "142"; 32 cut at 8 gave "152")


def test_completion_forms_stop_and_max_tokens(live, model):
    """Token-id prompts and several prompts per request (one choice each, in order); a stop
    string ends the text before it, streamed or not; max_tokens cuts the completion (the
    decode runs whole blocks) with finish_reason "length"."""
    ids = model.encode(PROMPTS[0])
    r = post(live, "/v1/completions", {"model": NAME, "prompt": [ids, PROMPTS[1]], "max_tokens": 32}).json()
    want = model.generate([PROMPTS[0], PROMPTS[1]], dlm_jax.preset("fast-dllm", gen_len=32)).texts
    assert [c["text"] for c in r["choices"]] == want and [c["index"] for c in r["choices"]] == [0, 1]
    full = want[0]
    stop = full[1:3]
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 32, "stop": [stop, "zzz"]}
    r = post(live, "/v1/completions", body).json()["choices"][0]
    assert r["text"] == full[:1] and r["finish_reason"] == "stop"
    assert stream_text(live, "/v1/completions", body)[0] == full[:1]
    sorted_ = model.generate([PROMPTS[2]], dlm_jax.preset("fast-dllm", gen_len=32)).token_ids[0]
    r = post(live, "/v1/completions", {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 5}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5
    assert r["choices"][0]["text"] == model.tokenizer.decode(sorted_[:5])


def test_n_choices_are_decodes_with_consecutive_seeds(live, model):
    """`n` choices of each prompt, from OpenAI's client, streamed or not: choice j of prompt i
    (index i * n + j) is the solo decode with seed `seed + j`; the usage counts each prompt once."""
    import openai

    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
    sampled = dlm_jax.preset("fast-dllm", gen_len=32, temperature=1.5)
    prompts = [PROMPTS[4], PROMPTS[3]]
    out = model.generate([p for p in prompts for _ in range(3)], sampled, seeds=[7, 8, 9] * 2)
    want = out.texts
    assert len(set(want[:3])) > 1  # (the seeds sample differently here: a shared seed would show)
    got = client.completions.create(model=NAME, prompt=prompts, n=3, seed=7, temperature=1.5, max_tokens=32)
    assert [c.index for c in got.choices] == list(range(6)) and [c.text for c in got.choices] == want
    assert got.usage.prompt_tokens == sum(len(model.encode(p)) for p in prompts)
    assert got.usage.completion_tokens == sum(len(ids) for ids in out.token_ids)
    streamed = {}
    for chunk in client.completions.create(model=NAME, prompt=prompts, n=3, seed=7, temperature=1.5, max_tokens=32,
                                           stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(6)] == want
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[4]}], n=2,
                                          seed=7, temperature=1.5, max_tokens=32)
    assert [c.message.content for c in chat.choices] == want[:2]
    greedy = client.completions.create(model=NAME, prompt=PROMPTS[0], n=2, max_tokens=32)
    solo = model.generate([PROMPTS[0]], dlm_jax.preset("fast-dllm", gen_len=32)).texts[0]
    assert [c.text for c in greedy.choices] == [solo, solo]


def test_streamed_text_never_takes_back_what_it_sent(model):
    """The pieces a stream sends join to the final text, token by token: a multibyte UTF-8
    character is held back until all its bytes are final (no replacement character is sent),
    and so is a tail that may begin a stop string, until the next token settles it."""
    from dlm_jax._engine import TextStream

    text = "é→ 12 ab12x cd"
    ids = model.tokenizer.encode(text)
    assert len(ids) > len(text)  # bytes: the accented letter and the arrow take several tokens
    stream = TextStream(model, stops=["12x", "zz"])
    pieces = [stream.update(ids[:n]) for n in range(1, len(ids) + 1)]
    pieces.append(stream.update(ids, end=True))
    assert "".join(pieces) == "é→ 12 ab" == stream.text(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "é→ 12 ab1" not in ["".join(pieces[:n]) for n in range(len(pieces))]  # "1", "12": held back


# ---------------------------------------------------------------------------- under load


def _mixed_requests(n: int, *, presets: bool = False) -> list[tuple[str, dict]]:
    """`n` requests of mixed prompts and options: steps of the warm decode's shapes, and with
    `presets` other decoders too (Frechet, the dual cache, LLaDA's, another block length)."""
    rng = np.random.default_rng(0)
    out = []
    kinds = [{}, {"threshold": 0.7}, {"threshold": 0.95}, {"temperature": 0.8, "seed": 1},
             {"stop": ["3"]}, {"top_p": 0.9, "temperature": 1.0, "seed": 7}]
    if presets:
        kinds += [{"preset": "frechet"}, {"preset": "fast-dllm-dual"}, {"preset": "llada", "steps": 16},
                  {"block_len": 16}]
    for i in range(n):
        body = {"model": NAME, "max_tokens": int(rng.choice([8, 16, 32]))}
        options = dict(kinds[i % len(kinds)])
        if "seed" in options:
            options["seed"] += i
        body.update({k: options.pop(k) for k in ("temperature", "seed", "stop", "top_p") if k in options})
        if options:
            body["dlm_jax"] = options
        if i % 3 == 2:
            body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
            out.append(("/v1/chat/completions", body))
        else:
            body["prompt"] = PROMPTS[i % len(PROMPTS)]
            out.append(("/v1/completions", body))
    return out


def _concurrent_clients_get_their_solo_answers(live, n: int, *, presets: bool = False) -> None:
    requests = _mixed_requests(n, presets=presets)
    alone = [stream_text(live, path, body)[0] for path, body in requests]
    start = threading.Barrier(n, timeout=DEADLINE)

    def client(i: int) -> str:
        start.wait()
        return stream_text(live, *requests[i])[0]

    with futures.ThreadPoolExecutor(n) as pool:
        together = list(pool.map(client, range(n), timeout=4 * DEADLINE))
    wrong = [(i, a, t) for i, (a, t) in enumerate(zip(alone, together)) if a != t]
    assert not wrong, f"{len(wrong)} of {n} concurrent clients got other text than alone: {wrong[:3]}"
    assert live.service.engine.core.stats.utilisation > 0


def test_concurrent_streaming_clients_get_their_solo_answers(live):
    """8 streaming clients at once, mixed prompts and options (threshold, sampling with a seed,
    top-p, stop strings, chat and text, lengths): each receives exactly the text it receives
    alone (32 clients: the slow test below)."""
    _concurrent_clients_get_their_solo_answers(live, 8)


@pytest.mark.slow
def test_32_concurrent_streaming_clients_get_their_solo_answers(live):
    """32 clients at once, with other decoders among them (Frechet, the dual cache, LLaDA's
    one-token steps, block 16), each receive the text they receive alone."""
    _concurrent_clients_get_their_solo_answers(live, 32, presets=True)


# ---------------------------------------------------------------------------- faults


def _cancelled(live) -> int:
    return live.service.engine.core.stats.retired.get("cancelled", 0)


# LLaDA's decoder, one token a step to the end (no early stop at an EOS block): 96 steps.
LONG = {"model": NAME, "prompt": "1+1=", "max_tokens": 96,
        "dlm_jax": {"preset": "llada", "steps": 96, "stop_on_eos_block": False}}


def test_a_client_that_disconnects_frees_its_row(live):
    """A client gone mid-stream, or gone while waiting for a whole answer, cancels its
    request: the engine retires it at its next step, long before the decode would end
    (128 steps), and frees its row."""
    core = live.service.engine.core
    before = _cancelled(live)
    with httpx.stream("POST", live.url + "/v1/completions", json={**LONG, "stream": True}, timeout=DEADLINE) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_until(lambda: _cancelled(live) == before + 1, what="the streamed request's cancellation")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(DEADLINE, read=0.15))
    wait_until(lambda: _cancelled(live) == before + 2, what="the waiting request's cancellation")
    wait_until(lambda: core.running == 0, what="the rows to be free")
    metrics = httpx.get(live.url + "/metrics").text
    assert 'dlm_jax_requests_total{endpoint="/v1/completions",outcome="disconnected"}' in metrics


def test_a_full_queue_answers_429_with_retry_after(live):
    """With the queue full the server answers 429 (rate_limit_error, Retry-After in seconds)
    and serves the next request once there is room."""
    core = live.service.engine.core
    core.max_waiting = 0  # no request may wait: every submit finds the queue full
    try:
        r = post(live, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0]})
    finally:
        core.max_waiting = 64
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error" and "queue is full" in r.json()["error"]["message"]
    assert post(live, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0]}).status_code == 200


BAD = {  # class: (body bytes or object, status, words the message names)
    "malformed JSON": (b'{"model": "llada-tiny", "prompt": ', 400, "not valid JSON"),
    "not an object": (b"[1, 2]", 400, "JSON object"),
    "NaN": (b'{"model": "llada-tiny", "prompt": "1", "temperature": NaN}', 400, "NaN"),
    "unknown field": ({"model": NAME, "prompt": "1", "frobnicate": 1}, 400, "frobnicate"),
    "wrong type": ({"model": NAME, "prompt": "1", "max_tokens": "32"}, 400, "max_tokens must be an integer"),
    "bool for int": ({"model": NAME, "prompt": "1", "max_tokens": True}, 400, "max_tokens must be an integer"),
    "prompt too long": ({"model": NAME, "prompt": "9" * 200}, 400, "exceeds"),
    "max_tokens out of range": ({"model": NAME, "prompt": "1", "max_tokens": 0}, 400, "max_tokens=0 is out of range"),
    "unknown preset": ({"model": NAME, "prompt": "1", "dlm_jax": {"preset": "fastest"}}, 400, "not a preset"),
    "unknown decode option": ({"model": NAME, "prompt": "1", "dlm_jax": {"speed": 2}}, 400, "dlm_jax.speed"),
    "option of another decoder": ({"model": NAME, "prompt": "1", "dlm_jax": {"stride": 2}}, 400, "stride"),
    "token id outside the vocabulary": ({"model": NAME, "prompt": [1, 99999]}, 400, "99999"),
    "best_of under n": ({"model": NAME, "prompt": "1", "best_of": 1, "n": 2}, 400, "best_of=1 must be at least n=2"),
    "best_of streamed": ({"model": NAME, "prompt": "1", "best_of": 2, "stream": True}, 400, "cannot be streamed"),
    "logit_bias key not a token id": ({"model": NAME, "prompt": "1", "logit_bias": {"x": 1}}, 400,
                                      "logit_bias key 'x' is not a token id"),
    "logit_bias out of range": ({"model": NAME, "prompt": "1", "logit_bias": {"5": -101}}, 400,
                                "logit_bias['5']=-101 must be a number from -100 to 100"),
    "penalty out of range": ({"model": NAME, "prompt": "1", "frequency_penalty": 2.5}, 400,
                             "frequency_penalty=2.5 is out of range"),
    "best_of beside a revising CPU path": ({"model": NAME, "prompt": "1", "best_of": 2,
                                            "dlm_jax": {"preset": "llada-cpp"}}, 400, "best_of ranks candidates"),
    "echo with logprobs": ({"model": NAME, "prompt": "1", "echo": True, "logprobs": 0}, 400,
                           "echo with logprobs is not supported"),
    "best_of x prompts past the queue's share": ({"model": NAME, "prompt": ["1", "2"], "best_of": 9}, 400,
                                                 "2 prompts x best_of=9 candidates in one request; at most 16"),
    "n = 0": ({"model": NAME, "prompt": "1", "n": 0}, 400, "n=0 is out of range"),
    "n x prompts past the queue's share": ({"model": NAME, "prompt": ["1", "2", "3"], "n": 6}, 400,
                                           "3 prompts x n=6 choices in one request; at most 16"),
    "no model": ({"prompt": "1"}, 400, "model is required"),
    "unknown model": ({"model": "gpt-4", "prompt": "1"}, 404, "not served here"),
    "non-UTF-8 bytes": (b'{"model": "llada-tiny", "prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    "half a surrogate pair": (b'{"model": "llada-tiny", "prompt": "a\\ud800"}', 400, "prompt holds an unpaired surrogate"),
    "10 MB body": (b'{"model": "llada-tiny", "prompt": "' + b"a" * (10 << 20) + b'"}', 413, "exceeds the limit"),
    "logprobs out of range": ({"model": NAME, "prompt": "1", "logprobs": 21}, 400, "logprobs=21 is out of range"),
    "logprobs beside a revising CPU path": ({"model": NAME, "prompt": "1", "logprobs": 1,
                                            "dlm_jax": {"preset": "llada-cpp"}}, 400, "refresh_rows=0"),
    "stop list too long": ({"model": NAME, "prompt": "1", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    "suffix not text": ({"model": NAME, "prompt": "1", "suffix": [5]}, 400, "suffix must be a string"),
    "suffix beside a revision policy": ({"model": NAME, "prompt": "1", "suffix": "2", "dlm_jax": {"preset": "llada-cpp"}},
                                        400, "suffix (infilling) does not go with"),
    "suffix too long": ({"model": NAME, "prompt": "1", "suffix": "9" * 200}, 400, "suffix (200 tokens)"),
    "suffix past whole blocks": ({"model": NAME, "prompt": "1", "suffix": "2", "max_tokens": 40}, 400,
                                 "max_tokens=40 with a suffix: an infill fills whole blocks of 32"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_gets_a_4xx_error_object(live, kind, capfd):
    """Each class of bad request gets its 4xx and an OpenAI error object whose message names
    the problem; nothing of it reaches the log as a traceback, and the server goes on serving."""
    body, status, words = BAD[kind]
    r = post(live, "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"] and "\n" not in error["message"]
    assert "Traceback" not in capfd.readouterr().err
    assert post(live, "/v1/completions", {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 32}).status_code == 200


def test_bad_chat_requests_and_routes(live):
    cases = [({"model": NAME, "messages": []}, 400, "messages must be a non-empty list"),
             ({"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
             ({"model": NAME, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
             ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
              "tools is not supported"),
             ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream_options": {}}, 400,
              "stream_options needs stream"),
             ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
              "top_logprobs needs logprobs: true"),
             ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, 400,
              "logprobs must be true or false")]
    for body, status, words in cases:
        r = post(live, "/v1/chat/completions", body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    chunks = (b'{"model": "llada-tiny", "prompt": "' if i == 0 else b"a" * (1 << 16) for i in range(40))
    r = httpx.post(live.url + "/v1/completions", content=chunks, timeout=DEADLINE)  # chunked: no Content-Length
    assert r.status_code == 413 and "exceeds the limit of 1048576 bytes" in r.json()["error"]["message"]
    r = httpx.get(live.url + "/v1/completions")
    assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"]
    r = httpx.get(live.url + "/v1/engines")
    assert r.status_code == 404 and "/v1/engines" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- health, metrics


def test_health_models_and_metrics(live):
    """/health is 200 when warm; /metrics parses with Prometheus' own parser and holds the
    series the docs list."""
    from prometheus_client.parser import text_string_to_metric_families

    health = httpx.get(live.url + "/health").json()
    assert health["status"] == "ready" and health["max_batch"] == 4
    assert httpx.get(live.url + "/v1/models").json()["data"][0]["id"] == NAME
    post(live, "/v1/completions", {"model": NAME, "prompt": "1", "frobnicate": 1})
    post(live, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0]})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)}
    for name in ("dlm_jax_requests_running", "dlm_jax_requests_waiting", "dlm_jax_batch_rows_busy",
                 "dlm_jax_tokens_per_second", "dlm_jax_time_to_first_chunk_seconds",
                 "dlm_jax_request_latency_seconds", "dlm_jax_refusals", "dlm_jax_generated_tokens"):
        assert name in families, sorted(families)
    refusals = {s.labels["reason"]: s.value for s in families["dlm_jax_refusals"].samples
                if s.name.endswith("_total")}
    assert refusals["invalid_request"] >= 1
    latency = {s.name: s.value for s in families["dlm_jax_request_latency_seconds"].samples}
    assert latency["dlm_jax_request_latency_seconds_count"] >= 1


def test_requests_wait_for_warm_up(model):
    """Before its warm-up is over the server refuses decodes with 503 (and /health says so)."""
    service = srv.Service(model, dlm_jax.preset("fast-dllm", gen_len=32), name=NAME, max_batch=4, max_tokens=128)
    with pytest.raises(srv.ApiError) as e:
        service.admit()
    assert e.value.status == 503 and e.value.code == "warming_up"


def test_warm_up_leaves_nothing_to_compile(model):
    """After `Engine.warmup` for a decode config, requests of that config with any prompt
    length compile nothing: no request waits for a compile."""
    from dlm_jax.runtime.engine import Engine

    cfg = dlm_jax.preset("fast-dllm", gen_len=32)
    engine = Engine(model.decoder, max_batch=3, max_tokens=80)
    engine.warmup([cfg])
    built = model.executor.build_counts().compiles
    rng = np.random.default_rng(1)
    reqs = [engine.submit(rng.integers(0, 200, size=int(n)), cfg) for n in (1, 9, 17, 33, 47, 48)]
    engine.run()
    assert all(r.status == "done" for r in reqs)
    assert model.executor.build_counts().compiles == built


def test_a_sampling_warm_up_leaves_sampled_requests_nothing_to_compile(model):
    """`--warmup-sampling` (`Service(warmup_sampling=True)`) builds the programs of requests
    that sample, set penalties or a logit_bias, or ask for logprobs: such requests, with
    options of their own, compile nothing (they would, each of its steps, without it)."""
    import openai

    service = srv.Service(model, dlm_jax.preset("fast-dllm", gen_len=32), name=NAME, max_batch=2, max_tokens=48,
                          warmup_sampling=True)
    live = LiveServer(service)  # (healthy once warm)
    try:
        built = model.executor.build_counts().compiles
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
        for kw in (dict(temperature=0.8, top_p=0.5, seed=1, logprobs=3),
                   dict(presence_penalty=1.0, logit_bias={"5": -100}),
                   dict(temperature=1.5, frequency_penalty=-0.5, logprobs=0, seed=2,
                        extra_body={"dlm_jax": {"top_k": 4}})):
            assert client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=32, **kw).choices[0].text
        assert model.executor.build_counts().compiles == built
    finally:
        live.stop()


@pytest.mark.slow  # (two servers' warm-ups: 15-20 s; the default pass checks the other warm-ups)
def test_an_infill_warm_up_leaves_suffix_requests_nothing_to_compile():
    """`--warmup-infill N` (`Service(warmup_infill=N)`) builds the programs of requests with a
    suffix of up to N tokens: suffixes of 3 and 6 tokens (one size of slots after the
    generation, 8) compile nothing after it, at a whole block and at fewer tokens than a block
    (a block of their own length), and compile without it (each server on a model of its
    own: its executor's programs its own)."""
    import openai

    def compiles(infill: int) -> list[int]:
        model = dlm_jax.load(TINY, executor="jax")
        service = srv.Service(model, dlm_jax.preset("fast-dllm", gen_len=32), name=NAME, max_batch=2,
                              max_tokens=56, warmup_infill=infill)
        live = LiveServer(service, ready_timeout=5 * DEADLINE)  # (healthy once warm: in the slow pass, its
        try:  # programs compile as users' do, a minute or more on two cores)
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE)
            new = []
            for suffix, n in ((" 99", 32), (" 1 2 3", 32), (" 99", 5), (" 1 2 3", 13), (" 1", 31)):
                built = model.executor.build_counts().compiles
                out = client.completions.create(model=NAME, prompt="66+76=", suffix=suffix, max_tokens=n)
                assert out.usage.completion_tokens <= n
                new.append(model.executor.build_counts().compiles - built)
            return new
        finally:
            live.stop()

    assert compiles(8) == [0] * 5
    assert sum(compiles(0)) > 0  # (a compile may be counted after its request answered)


@pytest.mark.slow  # (warm-ups of their own: 20 s)
def test_infill_and_sampling_warm_ups_together_leave_sampled_suffix_requests_nothing_to_compile():
    """`--warmup-infill 8 --warmup-sampling` (what `Service` warms with both): two suffix
    requests that sample with a penalty and ask for logprobs, in calls of two rows, compile nothing; with
    the two warm-ups apart (the sampling one over requests without a suffix) they compile the
    steps that return their logits."""
    def compiles(together: bool) -> int:
        model = dlm_jax.load(TINY, executor="jax")
        service = srv.Service(model, dlm_jax.preset("fast-dllm", gen_len=32), name=NAME, max_batch=2,
                              max_tokens=56, warmup_infill=8, warmup_sampling=together)
        service._warm_up()  # (its engine not started: the warm-up run here, then the requests)
        engine = service.engine.core
        if not together:  # the two warm-ups apart
            engine.warmup([srv.sampling_variant(c, engine.decoder) for c in service._warm_configs()])
        cfg = dlm_jax.preset("fast-dllm", gen_len=32, temperature=0.8, top_p=0.95, presence_penalty=0.3, logprobs=2)
        built = model.executor.build_counts().compiles
        reqs = [engine.submit(model.encode(p, chat=False), cfg, seed=s, suffix=model.encode(" 1 2", chat=False))
                for s, p in enumerate(PROMPTS[:2])]
        engine.run()
        assert all(r.status == "done" for r in reqs)
        return model.executor.build_counts().compiles - built

    assert compiles(True) == 0
    assert compiles(False) > 0


def test_an_infill_warm_up_of_a_model_that_cannot_infill_is_one_line(capsys):
    from dlm_jax.frontends.cli import main

    with pytest.raises(SystemExit) as ex:
        sys.exit(main(["serve", "--model", "models/idlm-tiny", "--port", "0", "--warmup-infill", "8"]))
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "needs a bidirectional model" in err and len(err.splitlines()) == 1 and "Traceback" not in err


# ---------------------------------------------------------------------------- SIGTERM


# 480 steps of LLaDA's decoder over a 484-token window (~30 ms each here): seconds of work.
LONGER = {"model": NAME, "prompt": "1+1=", "max_tokens": 480, "stream": True,
          "dlm_jax": {"preset": "llada", "steps": 480, "stop_on_eos_block": False}}


def test_drain_finishes_requests_in_flight_and_ends_the_rest_with_an_error(model):
    """A draining server (`Service.drain`, what SIGTERM starts) answers new requests 503 and
    lets requests in flight finish; when the grace period is cut short (a second SIGTERM),
    one still running ends with an error event (shutting_down), never a silent cut."""
    service = srv.Service(model, dlm_jax.preset("fast-dllm", gen_len=32), name=NAME, max_batch=4, warmup=False)
    live = LiveServer(service)
    try:
        lines: list[str] = []
        first = threading.Event()

        def long_client() -> None:
            with httpx.stream("POST", live.url + "/v1/completions", json=LONGER, timeout=DEADLINE) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        client = threading.Thread(target=long_client)
        client.start()
        assert first.wait(DEADLINE)
        short = futures.ThreadPoolExecutor(1).submit(stream_text, live, "/v1/completions",
                                                     {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 32})
        wait_until(lambda: service.engine.core.running == 2 or short.done(), what="the short request to start")
        drain = threading.Thread(target=service.drain, args=(DEADLINE,))
        drain.start()
        wait_until(lambda: service.state == "draining", what="draining")
        refused = post(live, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0]})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(live.url + "/health").status_code == 503
        text, chunks = short.result(DEADLINE)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and text
        service.hurry = True  # the grace period is over (a second SIGTERM)
        drain.join(DEADLINE)
        client.join(DEADLINE)
        assert any("shutting_down" in line for line in lines[-2:]), lines[-2:]
        assert lines[-1] == "data: [DONE]"
    finally:
        live.stop()


@pytest.mark.slow
def test_sigterm_finishes_running_requests_then_exits(tmp_path):
    """`dlm-jax serve` itself, in its own process: on SIGTERM it refuses new requests (503),
    finishes the ones in flight within the grace period (each stream ends with [DONE]), ends
    one longer than the grace period with an error event, and exits 0."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dlm_jax.frontends.cli", "serve", "--model", str(TINY), "--port", "0",
                             "--gen", "32", "--max-batch", "4", "--grace", "5", "--no-warmup"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        first = proc.stdout.readline()
        assert first.startswith("serving llada-tiny on http://127.0.0.1:"), first + proc.stderr.read()
        url = first.split()[3]
        wait_until(lambda: _health(url) == 200, what="the server to start")
        # The long request: LLaDA's decoder over 480 tokens, one a step (~30 ms each here), far
        # past the grace period; the short ones: 64 steps of the prefix cache (threshold 1: one
        # token a step), well within it.
        long_body = LONGER
        short_body = {"model": NAME, "max_tokens": 64, "stream": True,
                      "dlm_jax": {"threshold": 1.0, "stop_on_eos_block": False}}
        results: dict[str, list[str]] = {}
        started = threading.Barrier(4, timeout=DEADLINE)

        def client(name: str, body: dict) -> None:
            lines: list[str] = []
            results[name] = lines
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=DEADLINE) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 1:
                            started.wait()

        threads = [threading.Thread(target=client, args=("long", long_body))]
        threads += [threading.Thread(target=client, args=(f"short{i}", {**short_body, "prompt": PROMPTS[i]}))
                    for i in range(2)]
        for t in threads:
            t.start()
        started.wait()
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(url) in (503, None), what="the server to refuse new requests", timeout=10)
        for t in threads:
            t.join(DEADLINE)
        assert proc.wait(DEADLINE) == 0
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for i in range(2):
        lines = results[f"short{i}"]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"], lines[-3:]
    assert any("shutting_down" in line for line in results["long"][-2:]), results["long"][-2:]
    assert "draining" in out and "stopped" in out and "Traceback" not in err, (out, err)


@pytest.mark.slow
def test_a_tiered_server_is_ready_on_quick_programs_and_answers_the_same_on_full_ones(tmp_path, live):
    """`DLM_JAX_COMPILE=tiered dlm-jax serve`, in its own process over an empty compile cache,
    reading the cache in place (a GPU's form: a step's narrower windows share its read bucket):
    its ready line counts the programs compiled quick and those left to build behind (a
    narrower window's steps run padded in a wider one's program meanwhile), /metrics'
    `dlm_jax_programs_quick` falls to 0 as their full compiles come in, and its answers, on
    quick programs and on full ones, are those of the module's server (compiled in full, in
    this process, reading the cache in its gathered form)."""
    from prometheus_client.parser import text_string_to_metric_families

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DLM_JAX_COMPILE": "tiered", "DLM_JAX_ATTENTION": "split",
           "DLM_JAX_CACHE_DIR": str(tmp_path / "xla")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # (the tests' shared cache: this process starts cold)
    proc = subprocess.Popen([sys.executable, "-m", "dlm_jax.frontends.cli", "serve", "--model", str(TINY), "--port", "0",
                             "--gen", "32", "--max-batch", "4", "--max-tokens", "128"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)

    def quick() -> float:
        text = httpx.get(url + "/metrics", timeout=5).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        return families["dlm_jax_programs_quick"].samples[0].value

    bodies = [{"model": NAME, "prompt": p, "max_tokens": 32} for p in PROMPTS[:3]]
    try:
        url = proc.stdout.readline().split()[3]
        ready = proc.stdout.readline()
        assert ready.startswith("ready: ") and "compiled quick: their full compiles build behind" in ready, ready
        assert re.search(r", [1-9]\d* more build behind\)$", ready.strip()), ready
        early = [httpx.post(url + "/v1/completions", json=b, timeout=DEADLINE).json() for b in bodies]
        wait_until(lambda: quick() == 0, what="the full compiles", timeout=300)
        late = [httpx.post(url + "/v1/completions", json=b, timeout=DEADLINE).json() for b in bodies]
    finally:
        proc.terminate()
        proc.wait(DEADLINE)
    want = [post(live, "/v1/completions", b).json()["choices"][0]["text"] for b in bodies]
    assert [r["choices"][0]["text"] for r in early] == want == [r["choices"][0]["text"] for r in late]


def _status(url: str) -> int | None:
    try:
        return httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "1"}, timeout=5).status_code
    except httpx.TransportError:
        return None
