"""The HTTP server's contract, on a tiny model (fast): errors, 429, API key, disconnects,
SIGTERM draining, metrics. The SmolLM2 golden checks are in test_server_golden.py."""

from __future__ import annotations

import json
import os
import signal

import httpx
import openai
import pytest

from harness.serving import ServerProcess

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_artifacts, tmp_path_factory):
    srv = ServerProcess(
        tiny_artifacts[MODEL], tmp_path_factory.mktemp("srv") / "server.log", "--max-pending", "4"
    )
    yield srv
    srv.stop()


def post(srv, path, body, **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        f"{srv.url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
        **kw,
    )


def ok_request(srv):
    r = post(
        srv,
        "/v1/completions",
        {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


BAD = [
    ("malformed json", "/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("missing model", "/v1/completions", {"prompt": "x"}, 400, "model"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "wrong type max_tokens",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": "ten"},
        400,
        "max_tokens",
    ),
    ("wrong type prompt", "/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    (
        "bad role",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (
        "max_tokens zero",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 0},
        400,
        "max_tokens",
    ),
    (
        "max_tokens negative",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5},
        400,
        "max_tokens",
    ),
    (
        "prompt too long",
        "/v1/completions",
        {"model": MODEL, "prompt": "x" * 600, "max_tokens": 4},
        400,
        "max_tokens",
    ),
    (
        "completion too long",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 100000},
        400,
        "max_tokens",
    ),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    (
        "temperature out of range",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "temperature": 5},
        400,
        "temperature",
    ),
    ("top_p zero", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    (
        "top_k negative",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "top_k": -1},
        400,
        "top_k",
    ),
    ("n > 1", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    (
        "token id out of vocab",
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 2, 99999]},
        400,
        None,
    ),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
]


@pytest.mark.parametrize("case,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error_then_server_still_serves(
    server, case, path, body, status, param
):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert ok_request(server)["choices"][0]["finish_reason"] in ("length", "stop")


CHAT = [{"role": "user", "content": "hi"}]
# Fields trtc does not implement, at a value that asks for something: refused, never ignored.
UNIMPLEMENTED = [
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("logit_bias", {"5": 10}),
    ("min_p", 0.1),
    ("repetition_penalty", 1.2),
    ("top_logprobs", 3),
    ("best_of", 2),
    ("some_future_field", True),
]


@pytest.mark.parametrize("name,value", UNIMPLEMENTED, ids=[u[0] for u in UNIMPLEMENTED])
def test_a_field_trtc_does_not_implement_is_a_400_naming_it(server, name, value):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={name: value}
        )
    assert e.value.body["param"] == name and name in e.value.body["message"]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", name: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == name


def test_a_message_field_trtc_does_not_implement_is_a_400_naming_it(server):
    messages = [
        {"role": "user", "content": "what is 2 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
    ]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.tool_calls"


def test_bookkeeping_fields_and_neutral_values_are_taken(server):
    """What a client that sends every default sends: the same tokens as without them."""
    neutral = {
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "logit_bias": {},
        "min_p": 0,
        "repetition_penalty": 1.0,
        "top_logprobs": None,
    }
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    messages = [{"role": "user", "content": "hi", "name": "ann"}]
    plain = post(server, "/v1/chat/completions", {**base, "messages": CHAT})
    dressed = post(server, "/v1/chat/completions", {**base, **neutral, "messages": messages})
    assert plain.status_code == dressed.status_code == 200, dressed.text
    content = [r.json()["choices"][0]["message"]["content"] for r in (plain, dressed)]
    assert content[0] == content[1]


def test_official_client_raises_typed_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert "max_tokens" in str(e.value)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_queue_full_answers_429(server):
    """--max-pending 4: a fifth request while four stream gets 429, and the four finish."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    streams = [
        client.completions.create(
            model=MODEL,
            prompt="busy",
            max_tokens=300,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in range(4)
    ]
    firsts = [next(iter(s)) for s in streams]  # all four are admitted and running
    assert all(f.choices for f in firsts)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="one more", max_tokens=4)
    assert e.value.status_code == 429 and "capacity" in str(e.value)
    reasons = []
    for s in streams:
        for chunk in s:
            if chunk.choices and chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
    assert reasons == ["length"] * 4
    assert server.metrics()["trtc_rejected_requests_total"] >= 1
    assert ok_request(server)


def test_disconnects_free_blocks(server):
    """Finished, stopped and client-cancelled requests: afterwards every KV block is free."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    client.completions.create(model=MODEL, prompt="finish", max_tokens=8, temperature=0)
    stopped = client.completions.create(
        model=MODEL,
        prompt="stop",
        max_tokens=64,
        temperature=1.0,
        seed=3,
        stop=["e", "a", "o", "i"],
    )
    assert stopped.choices[0].finish_reason in ("stop", "length")
    # A streaming client that goes away after two chunks.
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        timeout=60,
        json={
            "model": MODEL,
            "prompt": "cancel me",
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    # A non-streaming client that times out (on this tiny model it may also just finish first).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions",
            timeout=0.3,
            json={"model": MODEL, "prompt": "slow", "max_tokens": 400, "ignore_eos": True},
        )
    m = server.wait_idle()
    assert m["trtc_kv_blocks_used"] == 0 and m["trtc_running_sequences"] == 0
    assert m['trtc_requests_total{finish_reason="abort"}'] >= 1


def test_stop_string_is_honoured(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    full = (
        client.completions.create(
            model=MODEL, prompt="abc", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert len(full) > 10
    stop = full[5:8]
    cut = client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_streaming_and_plain_agree(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kw = dict(model=MODEL, max_tokens=20, temperature=0)
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
    parts, reasons = [], []
    for chunk in client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        else:
            assert chunk.usage.completion_tokens == plain.usage.completion_tokens
    assert "".join(parts) == plain.choices[0].message.content
    assert reasons[-1] == plain.choices[0].finish_reason and not any(reasons[:-1])


def test_token_ids_count_every_token_even_without_text(server):
    """The tiny model's byte-level tokenizer decodes most ids to no text: the ``token_ids``
    extension still accounts for every token, chunk by chunk, and agrees with the usage."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(
        prompt="hi", **{**kw, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    )
    want = whole.model_dump()["choices"][0]["token_ids"]
    assert len(want) == whole.usage.completion_tokens == 24
    for endpoint in ("completions", "chat"):
        ids, empty_text, usage = [], 0, None
        create = (
            client.completions.create
            if endpoint == "completions"
            else client.chat.completions.create
        )
        prompt = (
            {"prompt": "hi"}
            if endpoint == "completions"
            else {"messages": [{"role": "user", "content": "hi"}]}
        )
        for chunk in create(
            **prompt,
            **{**kw, "extra_body": {"ignore_eos": True, "return_token_ids": True}},
            stream=True,
            stream_options={"include_usage": True},
        ):
            if not chunk.choices:
                usage = chunk.usage
                continue
            choice = chunk.model_dump()["choices"][0]
            ids += choice["token_ids"]
            text = choice["text"] if endpoint == "completions" else choice["delta"].get("content")
            empty_text += bool(choice["token_ids"]) and not text
        assert len(ids) == usage.completion_tokens == 24, endpoint
        assert empty_text > 0, "the check needs tokens without text"
        if endpoint == "completions":
            assert ids == want  # greedy: the same tokens streamed or whole
    # Without the extension, the chunks carry no token_ids.
    plain = client.completions.create(prompt="hi", **kw)
    assert "token_ids" not in plain.model_dump()["choices"][0] or (
        plain.model_dump()["choices"][0]["token_ids"] is None
    )


def test_metrics_exposes_serving_numbers(server):
    ok_request(server)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "trtc_queue_length",
        "trtc_running_sequences",
        "trtc_kv_blocks_used",
        "trtc_prefix_cache_hits_total",
        "trtc_time_to_first_token_seconds_bucket",
        "trtc_time_per_output_token_seconds_bucket",
        "trtc_prompt_tokens_total",
        "trtc_generation_tokens_total",
        "process_resident_memory_bytes",
    ):
        assert name in text, name
    h = httpx.get(f"{server.url}/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL


def test_api_key_required(tiny_artifacts, tmp_path):
    srv = ServerProcess(tiny_artifacts[MODEL], tmp_path / "server.log", "--api-key", "s3cret")
    try:
        r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/health").status_code == 200
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert (
            good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
            is not None
        )
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        srv.stop()


def test_sigterm_drains_in_flight_requests(tiny_artifacts, tmp_path):
    srv = ServerProcess(tiny_artifacts[MODEL], tmp_path / "server.log")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=MODEL,
        prompt="drain",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    next(it)
    (engine_pid,) = srv.children()
    srv.proc.send_signal(signal.SIGTERM)
    tokens, reason = 1, None
    for chunk in it:
        tokens += 1
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "length" and tokens > 2  # the request ran to its end after SIGTERM
    # uvicorn re-raises the signal after its graceful shutdown, so the exit status says SIGTERM.
    assert srv.proc.wait(timeout=60) in (0, -signal.SIGTERM)
    srv.stop()
    log = srv.log()
    assert "Shutting down" in log and "Finished server process" in log
    assert not os.path.exists(f"/proc/{engine_pid}")  # the engine process ended with it


def test_a_dead_engine_process_ends_the_streams_and_stops_the_server(tiny_artifacts, tmp_path):
    """The engine's process killed mid-stream: the stream ends at once, then the server exits
    with status 1 and says why (its supervisor restarts the replica); nothing hangs."""
    srv = ServerProcess(tiny_artifacts[MODEL], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=MODEL, prompt="x", max_tokens=400, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, timeout=60,
        )  # fmt: skip
        it = iter(stream)
        next(it)
        (engine_pid,) = srv.children()
        os.kill(engine_pid, signal.SIGKILL)
        reasons = [chunk.choices[0].finish_reason for chunk in it if chunk.choices]
        assert reasons[-1] == "abort" and len(reasons) < 400
        assert srv.proc.wait(timeout=30) == 1
        assert "the engine process ended (killed by SIGKILL)" in srv.log()
    finally:
        srv.stop()


def test_startup_phases_are_logged_and_exported(server):
    m = server.metrics()
    phases = {
        k[len('trtc_startup_seconds{phase="') : -2]: v for k, v in m.items() if "startup" in k
    }
    assert {"interpreter and imports", "tokenizer", "weights", "engine", "ready"} <= set(phases)
    assert all(v >= 0 for v in phases.values())
    # Ready (process start to serving) covers the phases before it.
    assert phases["ready"] >= sum(v for k, v in phases.items() if k != "ready") - 0.05
    assert "start-up: weights" in server.log() and "ready " in server.log()
