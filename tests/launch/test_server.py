"""``guidespec serve`` as a real process, driven by the official ``openai`` client: chat and
completion, streaming, structured output that validates, OpenAI-style errors, and a client that
disconnects mid-stream freeing its slot (seen in /metrics)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.launch.serving import KEY, start_server, stop_server
from tests.launch.test_tools import WEATHER

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
    from guidespec.launch.cli import main

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
    # the per-request speculative switch: configurations without speculation never draft
    assert all(lv["accepted_per_step"] == 1.0 for lv in levels if lv["config"] != "guided+spec")
    table = (tmp_path / "bench.md").read_text()
    assert table.count("| guided+spec |") == 2
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
