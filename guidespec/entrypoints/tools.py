"""OpenAI tool calling for the HTTP server: every call it returns was written under a grammar, so
its arguments are JSON that their function's ``parameters`` schema accepts.

What the output is, by ``tool_choice`` (``tools`` given):

- ``{"type": "function", "function": {"name": N}}``: N's arguments, one JSON document under N's
  schema (either backend);
- ``"required"``: a JSON array of calls ``{"name": ..., "arguments": {...}}``, each under its
  function's schema, at least one (exactly one with ``parallel_tool_calls: false``);
- ``"auto"`` (the default): text that never contains the marker ``<tool_call>``, or the marker
  followed by such an array: the model decides with its first tokens, and once it has written
  the marker its calls are enforced (a Lark grammar: llguidance);
- ``"none"``: no calls; the tools are not described and the request's own constraint, if any,
  applies.

The tools and that format are described to the model in a system message of guidespec's own
wording, the same for every model (a chat template's own tool format is not used). Past calls in
the conversation (an assistant message's ``tool_calls``) are written back in the same format;
``tool`` messages keep their role. Every field is checked here; a ``ToolError`` is the client's
fault (400).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from guidespec.protocol import GuidedDecoding

MARKER = "<tool_call>"
MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 4096
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of its prompt, its constraint and its reply. ``choice``: "none",
    "auto", "required" or "function" (then ``function`` names it)."""

    tools: tuple[Tool, ...]
    choice: str
    function: str | None = None
    parallel: bool = True

    @property
    def calls_tools(self) -> bool:
        return self.choice != "none"

    def guided(self) -> GuidedDecoding | None:
        """The constraint of the output (None: "none")."""
        if self.choice == "none":
            return None
        if self.choice == "function":
            return GuidedDecoding(json_schema=json.dumps(self._tool(self.function).parameters))
        if self.choice == "required":
            return GuidedDecoding(json_schema=json.dumps(self._calls_schema()))
        lark = (
            f"start: TEXT | {json.dumps(MARKER)} calls\n"
            f"calls: %json {json.dumps(self._calls_schema())}\n"
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(MARKER)}(?s:.*)/\n"
        )
        return GuidedDecoding(grammar=lark, backend="llguidance")

    def prompt(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with the tools described in the system message (one is added first where
        there is none)."""
        if self.choice == "none":
            return messages
        described = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in self.tools]
        calls = (
            'a JSON array of calls, each {"name": <a function\'s name>, "arguments": <its arguments as a JSON object>}'
        )
        if self.choice == "function":
            how = f"Reply with the arguments of the function {self.function} as a JSON object, and nothing else."
        elif self.choice == "required":
            how = f"Reply with {calls}, and nothing else."
        else:
            how = f"To call functions, reply with {MARKER} followed by {calls}. Otherwise reply in plain text."
        text = f"You can call these functions:\n{json.dumps(described, ensure_ascii=False)}\n{how}"
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def reply(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """The assistant message and finish reason of an output: its tool calls where it made
        any (finish reason "tool_calls"), else its text (an output cut inside a call, too)."""
        calls = self.calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI ``tool_calls`` an output made, or None (text, or a call cut short)."""
        if self.choice == "none":
            return None
        if self.choice == "auto":
            if not text.startswith(MARKER):
                return None
            text = text[len(MARKER) :]
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.choice == "function":
            made = [(self.function, value)]
        elif isinstance(value, list) and all(isinstance(c, dict) and "name" in c for c in value):
            made = [(c["name"], c.get("arguments", {})) for c in value]
        else:
            return None
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
            for name, arguments in made
        ]

    def may_call(self, text: str) -> bool | None:
        """For a stream: whether an output that begins with ``text`` is calls (True), text
        (False), or cannot tell yet (None)."""
        if self.choice in ("function", "required"):
            return True
        if self.choice == "none":
            return False
        if text.startswith(MARKER):
            return True
        return None if MARKER.startswith(text) else False

    def _tool(self, name: str | None) -> Tool:
        return next(t for t in self.tools if t.name == name)

    def _calls_schema(self) -> dict[str, Any]:
        defs: dict[str, Any] = {}
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": _embedded(t.parameters, f"tool{i}", defs)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, t in enumerate(self.tools)
        ]
        schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if defs:
            schema["$defs"] = defs
        schema["minItems"] = 1
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def _embedded(parameters: dict[str, Any], key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` to place inside the calls' schema: as they are, or where they refer to
    themselves or their own definitions (``$ref``: "#", "#/$defs/..." or "#/definitions/...",
    which would mean the calls' schema there), moved into its ``$defs`` under ``key`` with their
    references rewritten."""
    text = json.dumps(parameters)
    if '"$ref"' not in text:
        return parameters
    moved = json.loads(text)
    local = {**moved.pop("definitions", {}), **moved.pop("$defs", {})}
    for scope in ("$id", "id", "$schema"):  # (an $id would make the rewritten references its own)
        moved.pop(scope, None)

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            for prefix in ("#/$defs/", "#/definitions/"):
                if ref.startswith(prefix):
                    out["$ref"] = f"#/$defs/{key}.{ref[len(prefix) :]}"
                    break
            else:
                out["$ref"] = f"#/$defs/{key}{ref[1:]}"
        return out

    defs[key] = rewrite(moved)
    for name, definition in local.items():
        defs[f"{key}.{name}"] = rewrite(definition)
    return {"$ref": f"#/$defs/{key}"}


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked; None where
    it names no tools. Raises ToolError."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise ToolError(f"tools must be a list of 1 to {MAX_TOOLS} functions", "tools")
    parsed = tuple(_tool(tool, i) for i, tool in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ToolError("tools: two functions have the same name", "tools")
    if parallel_tool_calls not in (None, True, False):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in _CHOICES:
        return ToolPlan(parsed, tool_choice or "auto", parallel=parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise ToolError(f"tool_choice names {name[:64]!r}, which is not one of the tools", "tool_choice")
    return ToolPlan(parsed, "function", name, parallel)


def _tool(tool: Any, index: int) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    function = tool["function"]
    name, description = function.get("name"), function.get("description", "")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'", "tools")
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
        raise ToolError(f"{where}.function.description must be a string of at most {MAX_DESCRIPTION_CHARS}", "tools")
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters must be a JSON schema object", "tools")
    try:
        GuidedDecoding(json_schema=json.dumps(parameters)).validate()
    except ValueError as e:
        raise ToolError(f"{where}.function.parameters: {e}", "tools") from None
    return Tool(name, description, parameters)


def history_content(message: dict[str, Any], index: int) -> str:
    """An assistant message's text with its ``tool_calls`` written after it as the model writes
    calls (``MARKER`` + a JSON array), for the prompt."""
    content = message.get("content") or ""
    calls = message.get("tool_calls")
    if calls is None:
        return str(content)
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"{where} must be a non-empty list", "messages")
    written = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f'{where}: each call needs {{"function": {{"name": ..., "arguments": ...}}}}', "messages")
        arguments = function.get("arguments", "{}")
        try:
            value = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise ToolError(f"{where}: arguments must be JSON text", "messages") from None
        written.append({"name": function["name"], "arguments": value})
    return f"{content}{MARKER}{json.dumps(written, ensure_ascii=False)}"
