"""OpenAI's request fields to the engine's and its outputs back (``server/translate.py``),
without an engine: the constraint a body names, the 400s that name their field, and the shape
of responses and stream chunks. The server runs them end to end in ``test_server.py``."""

from __future__ import annotations

import json

import pytest

from guidespec.entrypoints.server.errors import APIError, refused
from guidespec.entrypoints.server.schemas import ChatRequest, CompletionRequest
from guidespec.entrypoints.server.translate import (
    chat_prompt,
    check_request,
    chunk,
    completion_prompt,
    error_event,
    max_tokens_for,
    response,
    sampling_params,
    served_by,
)
from guidespec.llm import GenerationOutput, RequestError
from guidespec.protocol import GuidedDecoding


def _body(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def _refusal(call: object, *args: object) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value


def test_a_constraint_comes_from_response_format_or_a_guided_field() -> None:
    schema = {"type": "object"}
    for fields in (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        {"guided_json": schema},
    ):
        params = sampling_params(_body(**fields), 8, "auto")
        assert params.guided == GuidedDecoding(json_schema=json.dumps(schema))
    params = sampling_params(_body(guided_choice=["a", "b"], guided_decoding_backend="xgrammar", top_k=-1), 8, "auto")
    assert params.guided == GuidedDecoding(choice=("a", "b"), backend="xgrammar") and params.top_k == 0
    assert sampling_params(_body(response_format={"type": "text"}), 8, "auto").guided is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"temperature": -1}, None),
    ],
)
def test_a_bad_constraint_or_parameter_is_a_400_naming_its_field(fields: dict, param: str | None) -> None:
    refusal = _refusal(sampling_params, _body(**fields), 8, "auto")
    assert (refusal.status, refusal.param) == (400, param)


def test_the_model_and_the_fields_a_request_names_are_checked() -> None:
    assert _refusal(check_request, _body(model="other"), "mine").status == 404
    refusal = _refusal(check_request, _body(logprobs=2, foo=1, user="u"), "mine")
    assert (refusal.status, refusal.message) == (400, "unsupported parameter(s): logprobs; unknown parameter(s): foo")
    check_request(_body(user="u", logprobs=False), "mine")  # ignored, and unsupported but off


def test_prompts_one_per_request_and_within_the_context() -> None:
    assert completion_prompt(["text"]) == "text" and completion_prompt([1, 2]) == {"prompt_token_ids": [1, 2]}
    assert _refusal(completion_prompt, ["a", "b"]).param == "prompt"
    assert max_tokens_for(_body(), 10, 64, 16) == 16 and max_tokens_for(_body(), 60, 64, None) == 4
    assert _refusal(max_tokens_for, _body(max_tokens=60), 10, 64, 16).param == "max_tokens"
    chat = ChatRequest.model_validate({"messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]}]})
    assert chat_prompt(chat) == ([{"role": "system", "content": "x"}], None)


def test_responses_chunks_and_errors_have_openais_shape() -> None:
    out = GenerationOutput("r", [1, 2], text="ok", token_ids=[3], finish_reason="length", grammar_backend="xgrammar")
    whole = response(out, "cmpl-1", "m", chat=False, tools=None)
    assert whole["choices"] == [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}]
    assert whole["usage"]["total_tokens"] == 3 and whole["usage"]["grammar_backend"] == "xgrammar"
    assert served_by(out) == {"X-Guidespec-Grammar-Backend": "xgrammar"}
    assert chunk("c", "m", True, {"content": "o"}, None)["object"] == "chat.completion.chunk"
    failed = RequestError("request r: xgrammar gave up: too deep", 500, "grammar_failed")
    assert json.loads(error_event(failed).removeprefix("data: "))["error"]["code"] == "grammar_failed"
    assert (refused(failed).status, refused(failed).message) == (500, "xgrammar gave up: too deep")
