"""Tool calling's plan (``guidespec/entrypoints/tools.py``), without an engine: what a request may send,
the schema its calls are written under, and how an output becomes ``tool_calls``. The server
runs it end to end in ``server/test_server.py``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from guidespec.entrypoints.tools import MARKER, ToolError, history_content, plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# a function whose parameters refer to their own definitions and to themselves
TREE = {
    "type": "function",
    "function": {
        "name": "plant",
        "parameters": {
            "$id": "https://example.com/plant.json",  # (references resolve against it, where it stands)
            "$defs": {"leaf": {"type": "object", "properties": {"size": {"type": "integer"}}, "required": ["size"]}},
            "type": "object",
            "properties": {"leaf": {"$ref": "#/$defs/leaf"}, "child": {"$ref": "#"}},
            "required": ["leaf"],
            "additionalProperties": False,
        },
    },
}


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param", "match"),
    [
        (None, "auto", None, "tool_choice", "needs tools"),
        ([], None, None, "tools", "1 to 128"),
        ([{"type": "function"}], None, None, "tools", r"tools\[0\] must be"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools", "letters, digits"),
        ([WEATHER, WEATHER], None, None, "tools", "same name"),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, None, "tools", "JSON schema"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": _deep(400)}}],
            None,
            None,
            "tools",
            "parameters: ",
        ),
        ([WEATHER], "sometimes", None, "tool_choice", "must be"),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}, None, "tool_choice", "not one of"),
        ([WEATHER], None, "yes", "parallel_tool_calls", "boolean"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(tools: Any, choice: Any, parallel: Any, param: str, match: str) -> None:
    with pytest.raises(ToolError, match=match) as refused:
        plan_tools(tools, choice, parallel)
    assert refused.value.param == param


def test_a_named_function_is_its_arguments() -> None:
    plan = plan_tools([WEATHER, TREE], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert plan is not None and plan.choice == "function"
    guided = plan.guided()
    assert guided is not None and json.loads(guided.json_schema or "") == WEATHER["function"]["parameters"]  # type: ignore[index]
    message, reason = plan.reply('{"city": "Paris"}', "stop")
    assert reason == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # cut short by max_tokens: the text, as it is
    assert plan.reply('{"city": "Par', "length") == ({"role": "assistant", "content": '{"city": "Par'}, "length")


def test_required_calls_follow_each_functions_schema_references_included() -> None:
    plan = plan_tools([WEATHER, TREE], "required", False)
    assert plan is not None
    schema = json.loads(plan.guided().json_schema or "")  # type: ignore[union-attr]
    good = [{"name": "plant", "arguments": {"leaf": {"size": 2}, "child": {"leaf": {"size": 1}}}}]
    jsonschema.validate(good, schema)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}], schema)
    for bad in (
        [],  # at least one
        good + good,  # parallel_tool_calls false: one
        [{"name": "plant", "arguments": {"leaf": {"size": "big"}}}],  # its definition
        [{"name": "plant", "arguments": {"leaf": {"size": 1}, "child": {"leaf": {}}}}],  # itself, nested
        [{"name": "get_weather", "arguments": {"leaf": {"size": 1}}}],  # another function's arguments
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    message, reason = plan.reply(json.dumps(good), "stop")
    assert reason == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == ["plant"]


def test_auto_is_text_or_the_marker_and_calls() -> None:
    plan = plan_tools([WEATHER], None, None)
    assert plan is not None and plan.choice == "auto"
    guided = plan.guided()
    assert guided is not None and guided.backend == "llguidance" and MARKER in (guided.grammar or "")
    assert plan.reply("It is sunny.", "stop") == ({"role": "assistant", "content": "It is sunny."}, "stop")
    message, reason = plan.reply(MARKER + '[{"name": "get_weather", "arguments": {"city": "Rome"}}]', "stop")
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert [plan.may_call(t) for t in ("", "<tool", MARKER + "[", "Hi", "<b>")] == [None, None, True, False, False]
    prompt = plan.prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}])
    assert (
        len(prompt) == 2 and prompt[0]["content"].startswith("Be brief.\n\n") and "get_weather" in prompt[0]["content"]
    )
    none = plan_tools([WEATHER], "none", None)
    assert none is not None and none.guided() is None and none.prompt(prompt[1:]) == prompt[1:]


def test_past_calls_are_written_back_as_the_model_writes_them() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    text = history_content({"role": "assistant", "content": None, "tool_calls": calls}, 1)
    assert text == MARKER + '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    with pytest.raises(ToolError, match="JSON text"):
        history_content({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}, 1)


def test_functions_with_references_accept_what_they_did_inside_the_calls_schema() -> None:
    """Every data-set schema with a ``$ref``, as a function's parameters: each of its test
    instances, as that function's arguments in a call, gets the verdict the schema gives it."""
    from tests.grammar_backends.dataset import SCHEMAS

    checked = 0
    for path in sorted(SCHEMAS.glob("*.json")):
        case = json.loads(path.read_text())
        if '"$ref"' not in json.dumps(case["schema"]):
            continue
        tools = [{"type": "function", "function": {"name": "f", "parameters": case["schema"]}}]
        plan = plan_tools(tools, "required", None)
        assert plan is not None
        calls = _validator(json.loads(plan.guided().json_schema or ""))  # type: ignore[union-attr]
        alone = _validator(case["schema"])
        for test in case["tests"]:
            assert calls.is_valid([{"name": "f", "arguments": test["data"]}]) == alone.is_valid(test["data"]), path.name
            checked += 1
    assert checked > 300


def _validator(schema: dict[str, Any]) -> Any:
    return jsonschema.validators.validator_for(schema)(schema)
