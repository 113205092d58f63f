"""``guidespec serve`` as a real process, driven by the official ``openai`` client: chat and
completion, streaming, structured output that validates, OpenAI-style errors, the API key and the
body size limit (a chunked upload too), every documented /metrics series, and a client that
disconnects mid-stream freeing its slot (seen in /metrics)."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from guidespec.entrypoints.server import MAX_BODY_BYTES
from tests.entrypoints.server.serving import AUTH, KEY, ROOT, start_server, stop_server
from tests.entrypoints.test_tools import WEATHER

pytestmark = pytest.mark.slow
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me a person as JSON."}]
# a schema whose long property names the grammar forces: every guided request under it drafts them
# (speculating or not: jump-forward), so its tokens per speculative step are surely above 1
FORCED = {
    "type": "object",
    "properties": {
        "the_name_of_the_largest_city_in_the_country": {"type": "string", "maxLength": 12},
        "its_population_in_millions_of_inhabitants": {"type": "integer"},
    },
    "required": ["the_name_of_the_largest_city_in_the_country", "its_population_in_millions_of_inhabitants"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    running = start_server("--max-batch-size", "4", "--speculative", "ngram")
    try:
        yield running.url
    finally:
        stop_server(running)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _metric(server: str, name: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=5).text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_models_chat_and_completion(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    chat = client.chat.completions.create(model=models[0].id, messages=ASK, max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens <= 12 and chat.usage.prompt_tokens > 5
    completion = client.completions.create(
        model=models[0].id, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text and completion.choices[0].finish_reason in ("stop", "length")


def test_streaming_equals_the_whole_response(client: openai.OpenAI) -> None:
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    streamed = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="1, 2, 3,", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed)


def test_a_stop_string_ends_the_answer_streamed_or_not(client: openai.OpenAI) -> None:
    """Stop strings are the client's to find (the server's ``LLM``: ``output_text``): the answer
    ends before the first one, streamed or not, with the same text and finish reason "stop"."""
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt="1, 2, 3, 4, 5, 6, 7,", max_tokens=40, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    assert "10" in plain
    whole = client.completions.create(stop=["10"], **kwargs)  # type: ignore[call-overload]
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].text == plain[: plain.index("10")]
    assert whole.usage is not None and 0 < whole.usage.completion_tokens < 40
    chunks = list(client.completions.create(stop=["10"], stream=True, **kwargs))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_structured_outputs_validate(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), PERSON)
    choice = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Phone: ",
        max_tokens=12,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    obj = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "SmolLM2-135M-Instruct"


def _valid_calls(calls: list, tools: list[dict]) -> list[str]:
    """The names of ``calls``, each checked against its function's parameters."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return [call.function.name for call in calls]


def test_tool_calls_follow_their_functions_schemas(client: openai.OpenAI) -> None:
    """A named function, "required" with one call, "auto" (text or calls), streamed the same, and
    a conversation that goes on after a call: every call valid under its function's schema."""
    tools = [WEATHER, TIME]
    weather = {"type": "function", "function": {"name": "get_weather"}}
    named = _ask_weather(client, tools, tool_choice=weather, max_tokens=40)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _valid_calls(choice.message.tool_calls or [], tools) == ["get_weather"]
    required = _ask_weather(client, tools, tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    assert len(_valid_calls(required.choices[0].message.tool_calls or [], tools)) == 1
    auto = _ask_weather(client, tools)
    message = auto.choices[0].message
    if message.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls" and _valid_calls(message.tool_calls, tools)
    else:
        assert "<tool_call>" not in (message.content or "")
    chunks = list(_ask_weather(client, tools, tool_choice=weather, max_tokens=40, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert deltas[0][0].function.arguments == (choice.message.tool_calls or [])[0].function.arguments
    call = (choice.message.tool_calls or [])[0]
    followed = client.chat.completions.create(
        model=MODEL,
        messages=[  # type: ignore[list-item]
            *WEATHER_ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "degrees": 21}'},
        ],
        tools=tools,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=12,
        temperature=0,
    )
    assert followed.choices[0].message.content and not followed.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        _ask_weather(client, tools, tool_choice={"type": "function", "function": {"name": "nowhere"}})


def _ask_weather(client: openai.OpenAI, tools: list[dict], **kwargs: Any) -> Any:
    kwargs = {"max_tokens": 60, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=tools, **kwargs)  # type: ignore[call-overload]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server: str, client: openai.OpenAI) -> None:
    bad_schema = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=ASK,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}},
        )
    assert e.value.status_code == 400 and "no-such-type" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="not valid JSON"):
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=8, extra_body={"guided_json": "{not json"}
        )
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="unknown parameter.*colour"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, extra_body={"colour": "red"})
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=ASK)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages="not a list")  # type: ignore[arg-type]
    body = httpx.post(
        f"{server}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"messages": ASK, "guided_regex": "[0-9"},
    ).json()
    assert body["error"]["code"] == 400 and body["error"]["type"] == "BadRequestError"
    ok = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=4)
    assert ok.choices[0].message.content is not None


def _assert_error(response: httpx.Response, status: int, kind: str) -> None:
    """An OpenAI-style error body of ``status``."""
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["code"] == status and error["type"] == kind, error


def test_the_api_key_guards_the_v1_routes_as_vllms_does(server: str) -> None:
    """No key, a wrong one, another scheme: 401 with OpenAI's error body, on every /v1 route. The
    scheme is case-insensitive (RFC 9110; vLLM's check). /health and /metrics need no key (vLLM's
    --api-key guards /v1 only; docs/usage.md says so)."""
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
        _assert_error(httpx.get(f"{server}/v1/models", headers=headers, timeout=30), 401, "AuthenticationError")
        chat = httpx.post(
            f"{server}/v1/chat/completions", headers=headers, json={"messages": ASK, "max_tokens": 2}, timeout=30
        )
        _assert_error(chat, 401, "AuthenticationError")
    for scheme in ("Bearer", "bearer", "BEARER"):
        models = httpx.get(f"{server}/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    assert "guidespec_num_requests_running" in httpx.get(f"{server}/metrics", timeout=30).text


def _padded(head: bytes, size: int) -> Iterator[bytes]:
    """``head``, then spaces to ``size`` bytes in all, 64 KiB at a time: JSON allows trailing
    whitespace, so the body is a valid request of any size (httpx sends a generator chunked)."""
    yield head
    sent = len(head)
    while sent < size:
        piece = min(1 << 16, size - sent)
        yield b" " * piece
        sent += piece


def _answer_to_an_unfinished_upload(server: str, size: int) -> bytes:
    """The start of the server's answer to a chunked upload of ``size`` bytes whose last chunk
    never comes (a server that reads a body whole before it checks its size never answers)."""
    url = httpx.URL(server)
    with socket.create_connection((url.host, url.port or 80), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.host}\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b" " * (1 << 20)
        for _ in range(-(-size // len(chunk))):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        return sock.recv(1 << 16)


def test_a_chunked_body_past_the_limit_is_refused_as_it_arrives(server: str) -> None:
    """A chunked upload has no Content-Length to check up front: the server counts its bytes as
    they arrive and answers 413 once they pass MAX_BODY_BYTES, without waiting for the rest. The
    body is a request that would be served if read whole; one under the limit is, chunked too."""
    head = json.dumps({"messages": ASK, "max_tokens": 2}).encode()
    url, headers = f"{server}/v1/chat/completions", {**AUTH, "Content-Type": "application/json"}
    small = httpx.post(url, headers=headers, content=_padded(head, 1 << 20), timeout=120)
    assert small.request.headers["transfer-encoding"] == "chunked" and "content-length" not in small.request.headers
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] <= 2, small.text[:300]
    big = httpx.post(url, headers=headers, content=_padded(head, MAX_BODY_BYTES + (1 << 20)), timeout=120)
    _assert_error(big, 413, "RequestTooLargeError")
    assert str(MAX_BODY_BYTES) in big.json()["error"]["message"]
    assert _answer_to_an_unfinished_upload(server, MAX_BODY_BYTES + (1 << 20)).startswith(b"HTTP/1.1 413 ")
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def _scrape(server: str) -> tuple[set[str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """/metrics: its series' names (counters with _total, as queried; not prometheus_client's
    _created timestamps), and every sample's value by name and labels."""
    text = httpx.get(f"{server}/metrics", timeout=5).text
    names = {name for name in re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE) if not name.endswith("_created")}
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return names, samples


def _documented_series() -> set[str]:
    usage = (ROOT / "docs" / "usage.md").read_text()
    server_section = usage.split("## OpenAI-compatible server", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(guidespec_\w+)", server_section))


def test_every_documented_metric_is_served_and_moves_with_traffic(server: str, client: openai.OpenAI) -> None:
    """The series docs/usage.md lists are the ones /metrics serves; after unguided, guided and
    speculating requests, a grammar one backend refuses, and refusals of three kinds, each counter
    and histogram moved by exactly what they were, and the gauges are back at rest."""
    names, before = _scrape(server)
    assert names == _documented_series()
    usages = [
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0).usage,
        client.completions.create(
            model=MODEL, prompt="France as JSON:", max_tokens=24, temperature=0, extra_body={"guided_json": FORCED}
        ).usage,
        list(
            client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                response_format={"type": "json_schema", "json_schema": {"name": "forced", "schema": FORCED}},
            )
        )[-1].usage,
    ]
    refused_by_xgrammar = {"type": "string", "pattern": "^[a-z]+$", "minLength": 2}  # llguidance serves it
    served = httpx.post(
        f"{server}/v1/completions",
        headers=AUTH,
        json={"prompt": "A word:", "max_tokens": 6, "guided_json": refused_by_xgrammar},
        timeout=120,
    )
    assert served.status_code == 200 and served.json()["usage"]["grammar_backend"] == "llguidance"
    figures = [u.model_dump() for u in usages if u is not None] + [served.json()["usage"]]
    assert len(figures) == 4 and figures[1]["spec_steps"] > 0 and figures[2]["spec_steps"] > 0
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, temperature=-1)
    assert httpx.get(f"{server}/v1/models", timeout=30).status_code == 401
    big = _padded(b"{}", MAX_BODY_BYTES + 1)
    assert httpx.post(f"{server}/v1/completions", headers=AUTH, content=big, timeout=120).status_code == 413
    deadline = time.monotonic() + 5  # (the queue's gauges follow the scheduler's reports, every 0.1 s at most)
    gauges = [f"guidespec_num_requests_{gauge}" for gauge in ("in_server", "running", "waiting", "waiting_for_grammar")]
    while any(_metric(server, gauge) for gauge in gauges):  # (a report can lag the last request by 0.1 s)
        assert time.monotonic() < deadline, "requests still counted as in the server, running or waiting"
        time.sleep(0.05)
    names, after = _scrape(server)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert names == _documented_series()
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"guidespec_{histogram}_count") == 4
    assert moved("guidespec_inter_token_latency_seconds_count") == sum(f["completion_tokens"] > 1 for f in figures)
    spec = [f["accepted_tokens_per_step"] for f in figures if f["spec_steps"]]
    assert moved("guidespec_accepted_tokens_per_step_count") == len(spec) >= 2
    assert moved("guidespec_accepted_tokens_per_step_sum") == pytest.approx(sum(spec), abs=1e-3)
    successes = [key for key in after if key[0] == "guidespec_request_success_total"]
    assert sum(after[key] - before.get(key, 0.0) for key in successes) == 4
    assert [moved("guidespec_request_failure_total", status=s) for s in ("400", "401", "413")] == [1, 1, 1]
    assert moved("guidespec_grammar_refusals_total", backend="xgrammar", keyword="minLength") == 1
    assert moved("guidespec_prompt_tokens_total") == sum(f["prompt_tokens"] for f in figures)
    assert moved("guidespec_generation_tokens_total") == sum(f["completion_tokens"] for f in figures)
    assert after[("guidespec_engine_restarts_total", ())] == 0
    # every admitted prompt is looked up, those of requests that failed or were aborted too
    queries = moved("guidespec_prefix_cache_queries_total")
    assert queries >= moved("guidespec_prompt_tokens_total") > 0
    assert 0 <= moved("guidespec_prefix_cache_hits_total") < queries
    # (the guided requests' grammars compiled here: one engine shares them with none)
    assert after[("guidespec_grammars_compiled_total", ())] >= 1 and after[("guidespec_grammars_shared_total", ())] == 0
    assert after[("guidespec_num_preemptions_total", ())] == 0 and after[("guidespec_kv_cache_usage_perc", ())] == 0
    for gauge in ("in_server", "running", "waiting", "waiting_for_grammar"):
        assert after[(f"guidespec_num_requests_{gauge}", ())] == 0


def test_the_backend_that_served_is_named_and_refusals_are_counted(server: str) -> None:
    """Backend auto (the default): xgrammar refuses 'minLength' beside a 'pattern', llguidance
    enforces it; the response names it, the metrics count xgrammar's refusal. A schema both
    refuse is a 400 naming both."""
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2}},
        "required": ["code"],
        "additionalProperties": False,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    for stream in (False, True):
        response = httpx.post(
            f"{server}/v1/chat/completions",
            headers=headers,
            timeout=120,
            json={"messages": ASK, "max_tokens": 24, "guided_json": schema, "stream": stream},
        )
        assert response.status_code == 200 and response.headers["x-guidespec-grammar-backend"] == "llguidance"
        if not stream:
            assert response.json()["usage"]["grammar_backend"] == "llguidance"
    text = httpx.get(f"{server}/metrics", timeout=5).text
    assert re.search(
        r'^guidespec_grammar_refusals_total\{backend="xgrammar",keyword="minLength"\} [1-9]', text, re.MULTILINE
    ), text[-2000:]
    both = httpx.post(
        f"{server}/v1/chat/completions",
        headers=headers,
        timeout=120,
        json={"messages": ASK, "max_tokens": 8, "guided_json": {"type": "string", "not": {"pattern": "^a"}}},
    )
    message = both.json()["error"]["message"]
    assert both.status_code == 400 and "xgrammar cannot enforce 'not'" in message and "llguidance" in message
    plain = httpx.post(
        f"{server}/v1/chat/completions",
        headers=headers,
        timeout=120,
        json={"messages": ASK, "max_tokens": 8, "guided_json": PERSON},
    )
    assert plain.headers["x-guidespec-grammar-backend"] == "xgrammar"


def test_a_disconnect_mid_stream_frees_the_slot(server: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": ASK, "max_tokens": 1500, "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server}/v1/chat/completions", headers=headers, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in received)
            # the scheduler reports its queue at most every 0.1 s: wait for the report, as a scraper would
            deadline = time.monotonic() + 5
            while _metric(server, "guidespec_num_requests_running") != 1:
                assert time.monotonic() < deadline, "the streaming request never showed as running"
                time.sleep(0.05)
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while _metric(server, "guidespec_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the disconnected request still holds its slot"
        time.sleep(0.2)
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200
    assert _metric(server, "guidespec_time_to_first_token_seconds_count") >= 1


def test_bench_against_the_server_writes_its_table_and_plot(server: str, tmp_path: Path) -> None:
    from guidespec.entrypoints.cli import main

    code = main(
        [
            "bench",
            "--url",
            server,
            "--api-key",
            KEY,
            "--synthetic",
            "--input-len",
            "12",
            "--num-prompts",
            "2",
            "--concurrency",
            "1",
            "2",
            "--max-tokens",
            "16",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    levels = json.loads((tmp_path / "bench.json").read_text())["levels"]
    assert [(lv["config"], lv["concurrency"]) for lv in levels] == [
        (c, n) for c in ("unguided", "guided", "guided+spec") for n in (1, 2)
    ]
    assert all(lv["errors"] == 0 and lv["output_tokens"] > 0 and lv["ttft_p50_s"] > 0 for lv in levels)
    assert all(lv["valid_fraction"] is not None for lv in levels if lv["config"] != "unguided")
    # the per-request speculative switch: configurations without speculation never draft (these
    # prompts' outputs, "{}", have no forced tokens, which a guided request drafts even without it)
    assert all(lv["accepted_per_step"] == 1.0 for lv in levels if lv["config"] != "guided+spec")
    table = (tmp_path / "bench.md").read_text()
    assert table.count("| guided+spec |") == 2
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    # the figure is the server's, not bench's default of 1.0: a schema whose long property names
    # the grammar forces surely drafts (and has its drafts accepted) with speculation on
    workload = tmp_path / "forced.jsonl"
    case = {"id": "forced", "messages": [{"role": "user", "content": "France, as JSON."}], "schema": FORCED}
    workload.write_text(json.dumps(case) + "\n")
    forced_dir = tmp_path / "forced"
    code = main(
        ["bench", "--url", server, "--api-key", KEY, "--workload", str(workload), "--num-prompts", "1"]
        + ["--configs", "unguided", "guided+spec", "--concurrency", "1", "2", "--max-tokens", "24"]
        + ["--output-dir", str(forced_dir)]
    )
    assert code == 0
    levels = json.loads((forced_dir / "bench.json").read_text())["levels"]
    assert [(lv["config"], lv["errors"]) for lv in levels] == [("unguided", 0)] * 2 + [("guided+spec", 0)] * 2
    assert [lv["accepted_per_step"] for lv in levels[:2]] == [1.0, 1.0], levels
    assert all(lv["accepted_per_step"] > 1.0 for lv in levels[2:]), levels


def test_issue_45s_string_schema_is_a_valid_answer_never_an_empty_stop(server: str) -> None:
    """xgrammar refuses it; llguidance's matcher gave up after the opening quote and the server
    answered 200, finish_reason "stop", content "" (issue 45). Now: a valid answer, streamed too."""
    schema = {
        "type": "string",
        "pattern": "[aA][12].*[zZ]",
        "minLength": 10,
        "maxLength": 90,
        "anyOf": [{"pattern": p} for p in ("ab1", "b12", "bc1", "c12", "ca1", "a12")],
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "A code that starts with a12 and ends with z, as a JSON string."}],
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "code", "schema": schema}},
    }
    answer = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and answer.headers["X-Guidespec-Grammar-Backend"] == "llguidance"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", headers=AUTH, json={**body, "stream": True}, timeout=300
    ) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "stop"
    jsonschema.validate(json.loads(text), schema)
